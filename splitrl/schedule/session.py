"""The thin workers around a schedule: each stage as a process, and both in one process (the twin).

A worker owns what the compute objects must not: the link, the handshake, the
run directory, and stopping cleanly. Any error on one side is sent to the peer
as ``abort`` before it propagates, so the other side stops too instead of
waiting out its timeout.

The twin builds the same `Edge` and `Learner` and runs the same schedule over
an in-process link (`LocalTransport`), stage1's loop on a thread of its own; with
the same seed it computes what the split run computes, bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from ..envs import EnvSpec, inspect_env
from ..runs import RunLog, default_run_dir
from ..settings import RunOptions, TrainSettings
from ..stages import LIMITS, STAGE0, STAGE1, Edge, Learner, edge_exchange, learner_exchange
from ..transport import PeerAbort, TcpTransport, Transport, TransportTimeout, ZmqTransport
from ..transport.handshake import check_hello, handshake, send_hello
from ..transport.local import LocalTransport
from . import asynchronous, pipelined, sync

SCHEDULES = {"sync": sync, "pipelined": pipelined, "async": asynchronous}
"""``settings.schedule.mode`` -> the module whose ``stage0_loop`` / ``stage1_loop`` run it."""

__all__ = ["prepare", "open_link", "serve_stage0", "serve_stage1", "run_stage0", "run_stage1", "train_twin"]

log = logging.getLogger(__name__)


def prepare(settings: TrainSettings, options: RunOptions, role: str) -> tuple[EnvSpec, RunLog]:
    """Check everything before any socket opens; set threads; write the config file."""
    settings.validate(options)
    spec = inspect_env(settings.env)
    if options.threads:
        torch.set_num_threads(options.threads)
    run_log = RunLog(options.run_dir or default_run_dir(settings.env.env_id))
    config: dict[str, Any] = {
        "settings": settings.to_dict(),
        "options": dataclasses.asdict(options),
        "env_spec": dataclasses.asdict(spec),
        "torch_threads": torch.get_num_threads(),
    }
    run_log.write_config(config, "config.json" if role == "twin" else f"config-{role}.json")
    return spec, run_log


def open_link(options: RunOptions, endpoint: str, *, bind: bool, peer: str) -> Transport:
    """The link to the other stage, as chosen by ``--transport``."""
    if options.transport == "torch-rpc":
        from ..transport.torch_rpc import TorchRpcTransport  # imports torch.distributed: only when asked

        cls: type[Transport] = TorchRpcTransport
    else:
        cls = {"zmq": ZmqTransport, "tcp": TcpTransport}[options.transport]
    return cls(endpoint, bind=bind, timeout=options.timeout, limits=LIMITS, name=peer)


def make_edge(settings: TrainSettings, spec: EnvSpec, run_log: RunLog | None, options: RunOptions) -> Edge:
    """Stage0's compute, with as many rollout slots and acting copies as the schedule needs."""
    concurrent = settings.schedule.mode == "async"
    return Edge(settings, spec, run_log, vector=options.vector, acting_copy=concurrent,
                slots=settings.schedule.max_staleness + 1 if concurrent else 1)


def make_learner(settings: TrainSettings, spec: EnvSpec) -> Learner:
    """Stage1's compute, with as many rollout slots and acting copies as the schedule needs."""
    concurrent = settings.schedule.mode == "async"
    return Learner(settings, spec, acting_copy=concurrent, slots=settings.schedule.max_staleness + 1 if concurrent else 1)


def serve_stage0(edge: Edge, link: Transport, *, checkpoint_every: int = 10,
                 start_timeout: float | None = None) -> list[dict[str, Any]]:
    """Handshake, every iteration, close. Returns the metrics records."""
    try:
        handshake(link, STAGE0, STAGE1, edge.settings.shared(), timeout=start_timeout)
        try:
            records = SCHEDULES[edge.settings.schedule.mode].stage0_loop(edge, edge_exchange(edge), link,
                                                                         checkpoint_every=checkpoint_every)
        finally:
            edge.close()
        link.send("close")
    except BaseException as exc:
        link.abort(f"stage0 failed: {type(exc).__name__}: {exc}")
        raise
    return records


def serve_stage1(learner: Learner, link: Transport, run_log: RunLog | None = None, *,
                 start_timeout: float | None = None) -> int:
    """Answer stage0's hello, serve every iteration until stage0 closes; returns the iterations served."""
    shared = learner.settings.shared()
    try:
        hello = link.recv(timeout=start_timeout)
        send_hello(link, STAGE1, shared)  # answer before checking, so a mismatch is reported on both sides
        check_hello(hello, STAGE1, STAGE0, shared, link.peer)
        log.info("[stage1] stage0 connected")
        served = SCHEDULES[learner.settings.schedule.mode].stage1_loop(learner, learner_exchange(learner), link, run_log)
    except BaseException as exc:
        link.abort(f"stage1 failed: {type(exc).__name__}: {exc}")
        raise
    log.info("[stage1] stage0 closed the session after %d iterations", served)
    return served


def run_stage0(settings: TrainSettings, options: RunOptions, connect: str) -> list[dict[str, Any]]:
    spec, run_log = prepare(settings, options, STAGE0)
    edge = make_edge(settings, spec, run_log, options)
    with open_link(options, connect, bind=False, peer=f"stage1 at {connect}") as link:
        log.info("[stage0] connecting to stage1 at %s", connect)
        return serve_stage0(edge, link, checkpoint_every=options.checkpoint_every, start_timeout=options.start_timeout)


def run_stage1(settings: TrainSettings, options: RunOptions, bind: str) -> int:
    spec, run_log = prepare(settings, options, STAGE1)
    learner = make_learner(settings, spec)
    with open_link(options, bind, bind=True, peer="stage0") as link:
        log.info("[stage1] listening on %s (%s)", link.endpoint, options.transport)
        return serve_stage1(learner, link, run_log, start_timeout=options.start_timeout)


def train_twin(settings: TrainSettings, options: RunOptions) -> list[dict[str, Any]]:
    """Both stages in this process over an in-process link: the no-network baseline."""
    spec, run_log = prepare(settings, options, "twin")
    learner = make_learner(settings, spec)
    edge = make_edge(settings, spec, run_log, options)
    link0, link1 = LocalTransport.pair(STAGE0, STAGE1, limits=LIMITS, timeout=options.timeout)
    failure: list[BaseException] = []

    def stage1() -> None:
        try:
            serve_stage1(learner, link1, run_log, start_timeout=options.start_timeout)
        except BaseException as exc:  # reported by the main thread, which stage0's abort wakes
            failure.append(exc)

    thread = threading.Thread(target=stage1, name="stage1", daemon=True)
    thread.start()
    try:
        records = serve_stage0(edge, link0, checkpoint_every=options.checkpoint_every,
                               start_timeout=options.start_timeout)
    except (PeerAbort, TransportTimeout):
        thread.join(timeout=10)
        if failure:  # stage0 only heard that stage1 stopped: stage1's own error says why
            raise failure[0] from None
        raise
    except BaseException:
        thread.join(timeout=10)
        if failure:
            log.info("[stage1] stopped too: %s: %s", type(failure[0]).__name__, failure[0])
        raise
    thread.join(timeout=options.timeout)
    if failure:
        raise failure[0]
    if thread.is_alive():
        raise RuntimeError(f"stage1's thread did not finish within {options.timeout:g} s of stage0's close")
    return records
