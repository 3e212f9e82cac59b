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
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..envs import EnvSpec, inspect_env
from ..runs import (RunLog, check_fresh, checkpoint_iterations, default_run_dir, load_checkpoint, read_metrics,
                    truncate_logs)
from ..settings import RunOptions, SettingsError, TrainSettings
from ..stages import LIMITS, STAGE0, STAGE1, Edge, Learner, edge_exchange, learner_exchange
from ..stages.evaluate import Evaluation
from ..stages.learners import Learners, edge_range
from ..transport import PeerAbort, PeerGone, ProtocolError, TcpTransport, Transport, TransportTimeout, ZmqTransport
from ..transport.curve import client_keys, server_keys
from ..transport.endpoints import is_local, slot_endpoint
from ..transport.errors import peer_repr
from ..transport.handshake import HandshakeError, answer_hello, handshake
from ..transport.local import LocalTransport
from . import asynchronous, fleet, pipelined, sync
from .common import after_progress, torch_thread

SCHEDULES = {"sync": sync, "pipelined": pipelined, "async": asynchronous, "fleet": fleet}
"""``settings.schedule.mode`` -> the module whose ``stage0_loop`` / ``stage1_loop`` run it."""

__all__ = ["prepare", "open_link", "serve_stage0", "serve_stage1", "run_stage0", "run_stage1", "train_twin"]

log = logging.getLogger(__name__)


def prepare(settings: TrainSettings, options: RunOptions, role: str) -> tuple[EnvSpec, RunLog]:
    """Check everything before any socket opens; set threads; write the config file.

    A run directory that holds a run already is refused, unless ``--resume`` (its settings must be
    this run's, but for ``total_steps``) or ``--overwrite`` (its metrics, episodes and checkpoints go)."""
    settings.validate(options)
    spec = inspect_env(settings.env)
    if options.threads:
        torch.set_num_threads(options.threads)
    run_dir = options.resume or options.run_dir or default_run_dir(settings.env.env_id)
    config_name = "config.json" if role == "twin" else f"config-{role}.json"
    if options.resume:
        _check_resumable(Path(run_dir), config_name, settings)
    elif options.overwrite:
        _clear(Path(run_dir))
    else:
        check_fresh(run_dir)
    # stage0 writes the metrics (stage1's keys ride on them), so TensorBoard is stage0's, or the twin's.
    run_log = RunLog(run_dir, keep=options.keep_checkpoints, tensorboard=options.tensorboard and role != STAGE1)
    config: dict[str, Any] = {
        "settings": settings.to_dict(),
        "options": dataclasses.asdict(options),
        "env_spec": dataclasses.asdict(spec),
        "torch_threads": torch.get_num_threads(),
    }
    run_log.write_config(config, config_name)
    return spec, run_log


def _check_resumable(run_dir: Path, config_name: str, settings: TrainSettings) -> None:
    path = run_dir / config_name
    if not path.exists():
        raise SettingsError(f"--resume {run_dir}: no {config_name} there (is it this stage's run directory?)")
    # A run made before a setting existed ran with its default: it reads back as such.
    saved = _flatten(TrainSettings.from_dict(json.loads(path.read_text())["settings"]).to_dict())
    now = _flatten(settings.to_dict())
    differ = [f"{key}: the run has {saved.get(key)!r}, now {now.get(key)!r}" for key in sorted(set(saved) | set(now))
              if key != "total_steps" and saved.get(key) != now.get(key)]
    if differ:
        raise SettingsError(f"--resume {run_dir}: the settings differ from the run's (only --total-steps may): "
                         + "; ".join(differ))


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _clear(run_dir: Path) -> None:
    for name in ("metrics.jsonl", "episodes.jsonl"):
        (run_dir / name).unlink(missing_ok=True)
    if (run_dir / "checkpoints").is_dir():
        shutil.rmtree(run_dir / "checkpoints")


def _resume_point(peer_hello: dict[str, Any], ours: list[int]) -> int:
    """The newest iteration both stages have a checkpoint of (0: none)."""
    theirs = peer_hello.get("checkpoints")
    if theirs is None:
        raise HandshakeError("the peer does not resume: this side continues a run (--resume, or a rejoin after "
                             "the peer was lost), so start the peer with --resume RUN_DIR too")
    if not isinstance(theirs, list) or not all(isinstance(i, int) for i in theirs):
        raise ProtocolError(f"hello: expected the peer's checkpoint iterations as a list of ints, got {peer_repr(theirs)}")
    return max(set(ours) & set(theirs), default=0)


def open_link(options: RunOptions, endpoint: str, *, bind: bool, peer: str) -> Transport:
    """The link to the other stage, as chosen by ``--transport`` (and ``--curve``, ``--heartbeat``)."""
    if options.transport == "torch-rpc":
        from ..transport.torch_rpc import TorchRpcTransport  # imports torch.distributed: only when asked

        return TorchRpcTransport(endpoint, bind=bind, timeout=options.timeout, limits=LIMITS, name=peer)
    if options.transport == "tcp":
        return TcpTransport(endpoint, bind=bind, timeout=options.timeout, limits=LIMITS, name=peer,
                            heartbeat=options.heartbeat)
    keys = None
    if options.curve:
        keys = server_keys(options.curve) if bind else client_keys(options.curve, options.curve_name)
    return ZmqTransport(endpoint, bind=bind, timeout=options.timeout, limits=LIMITS, name=peer,
                        heartbeat=options.heartbeat, curve=keys)


def check_exposure(options: RunOptions, endpoint: str, *, bind: bool) -> None:
    """A link beyond this machine needs --curve, or --insecure (and then a warning): without CURVE anyone
    who reaches the ports can drive the learner and read the traffic."""
    if options.curve or is_local(endpoint):
        return
    doing = "binding" if bind else "connecting to"
    if not options.insecure:
        raise SettingsError(f"{doing} {endpoint} opens the link beyond this machine without authentication: "
                            "use --curve DIR (keys from `splitrl keys DIR`), or --insecure on a network that is "
                            "yours alone")
    log.warning("[%s] --insecure: %s %s without CURVE; anyone who reaches it can drive the learner and read the "
                "traffic", STAGE1 if bind else STAGE0, doing, endpoint)


def make_edge(settings: TrainSettings, spec: EnvSpec, run_log: RunLog | None, options: RunOptions,
              edge: int = 0) -> Edge:
    """Stage0's compute (edge ``edge`` of a fleet), with as many rollout slots and acting copies as the schedule
    needs."""
    concurrent = settings.schedule.mode == "async"
    return Edge(settings, spec, run_log, vector=options.vector, acting_copy=concurrent,
                slots=settings.schedule.max_staleness + 1 if concurrent else 1, edge=edge)


def make_evaluation(settings: TrainSettings, spec: EnvSpec, options: RunOptions) -> Evaluation | None:
    """Stage0's scoring during training, if ``--eval-every`` asks for it."""
    return Evaluation(settings, spec, options.eval_every, options.eval_episodes) if options.eval_every else None


def make_learner(settings: TrainSettings, spec: EnvSpec) -> Learner:
    """Stage1's compute, with as many rollout slots and acting copies as the schedule needs; a fleet's learns as
    one edge with all the edges' envs (`TrainSettings.fleet_view`)."""
    concurrent = settings.schedule.mode == "async"
    return Learner(settings.fleet_view(), spec, acting_copy=concurrent,
                   slots=settings.schedule.max_staleness + 1 if concurrent else 1)


def _recorded_checkpoints(run_dir: Path) -> list[int]:
    """Stage0's checkpoints whose iteration has its metrics record: the checkpoint is written before the record
    (the record needs stage1's statistics, which come with the end of the iteration), so a run stopped between the
    two resumes from the checkpoint before, and redoes that iteration, rather than leave a hole in metrics.jsonl."""
    try:
        recorded = {int(r["iteration"]) for r in read_metrics(run_dir)}
    except ValueError:  # no metrics.jsonl: no iteration was recorded
        recorded = set()
    return [i for i in checkpoint_iterations(run_dir, STAGE0) if i in recorded]


def serve_stage0(edge: Edge, link: Transport, *, checkpoint_every: int = 10, start_timeout: float | None = None,
                 resume: bool = False, evaluation: Evaluation | None = None) -> list[dict[str, Any]]:
    """Handshake, every iteration (from the newest checkpoint both stages have, with ``resume``), close.
    Returns the metrics records."""
    try:
        exchange = edge_exchange(edge)
        ours = _recorded_checkpoints(edge.run_log.dir) if resume else []
        extra = {**({"checkpoints": ours} if resume else {}),
                 **({"edge": edge.edge} if edge.settings.schedule.edges > 1 else {})}
        hello = handshake(link, STAGE0, STAGE1, edge.settings.shared(), timeout=start_timeout, extra=extra or None)
        join_after = hello.get("join_after", 0) if edge.settings.schedule.edges > 1 else 0
        if join_after:  # a fleet that has trained: start from one of its edges' encoder
            if type(join_after) is not int or not 0 < join_after < edge.settings.num_iterations:
                raise ProtocolError(f"hello: join_after must be an iteration of the run, got {peer_repr(join_after)}")
            # stage1's progress messages come first while it waits for more edges, trains, or the sharing edge
            # scores the policy; joining is part of starting: --start-timeout
            state = after_progress(link, "encoder_state", start_timeout, iteration=join_after)
            edge.join(state, join_after)
            log.info("[stage0] joined the fleet after its iteration %d", join_after)
        if resume and join_after:
            # It joined the running fleet with another edge's encoder: its own records and checkpoints after the
            # join are of another past; they go, and the run goes on appending from the join.
            resume = False
            truncate_logs(edge.run_log.dir, join_after)
            edge.run_log.drop_checkpoints_after(STAGE0, join_after)
            log.info("[stage0] its own checkpoints are not used: it joined the fleet after iteration %d", join_after)
        if resume:
            iteration = _resume_point(hello, ours)
            if edge.settings.schedule.edges > 1:
                # The fleet's point is common to stage1 and every edge: stage1 says it once all are in.
                said = after_progress(link, "resume", start_timeout).header.get("iteration")
                if type(said) is not int or said < 0 or (said and said not in ours):
                    raise ProtocolError(f"resume: stage1 resumes the fleet after iteration {peer_repr(said)}; this "
                                        f"edge has checkpoints of {ours or 'none'}")
                iteration = said
            if iteration:
                state = load_checkpoint(edge.run_log.dir, STAGE0, iteration)
                edge.load_state_dict(state)
                exchange.load_state_dict(state["exchange"])
                link.meter.restore(state["meter"])
            truncate_logs(edge.run_log.dir, iteration)
            if edge.budget is not None and iteration:
                edge.last_record = edge.budget.resume(read_metrics(edge.run_log.dir))
            log.info("[stage0] resuming after iteration %d", iteration)
        try:
            records = SCHEDULES[edge.settings.schedule.mode].stage0_loop(edge, exchange, link,
                                                                         checkpoint_every=checkpoint_every,
                                                                         evaluation=evaluation)
        finally:
            edge.close()
        link.send("close")
    except BaseException as exc:
        link.abort(f"stage0 failed: {type(exc).__name__}: {exc}")
        raise
    return records


def serve_stage1(learner: Learner, link: Transport, run_log: RunLog | None = None, *,
                 start_timeout: float | None = None, resume: bool = False) -> int:
    """Answer stage0's hello, serve every iteration until stage0 closes; returns the iterations served."""
    shared = learner.settings.shared()
    try:
        exchange = learner_exchange(learner)
        ours = checkpoint_iterations(run_log.dir, STAGE1) if resume and run_log is not None else []
        # Answers before checking, so a mismatch is reported on both sides.
        hello = answer_hello(link, STAGE1, STAGE0, shared, timeout=start_timeout,
                             extra={"checkpoints": ours} if resume else None)
        log.info("[stage1] stage0 connected")
        if resume:
            iteration = _resume_point(hello, ours)
            if iteration:
                state = load_checkpoint(run_log.dir, STAGE1, iteration)
                learner.load_state_dict(state)
                exchange.load_state_dict(state["exchange"])
            log.info("[stage1] resuming after iteration %d", iteration)
        served = SCHEDULES[learner.settings.schedule.mode].stage1_loop(learner, exchange, link, run_log)
    except PeerGone:
        raise  # nobody to tell; an abort left queued could meet a rejoining stage0 first
    except BaseException as exc:
        link.abort(f"stage1 failed: {type(exc).__name__}: {exc}")
        raise
    log.info("[stage1] stage0 closed the session after iteration %d", served)
    return served


def join_fleet(options: RunOptions, connect: str, edges: int) -> tuple[Transport, int]:
    """A fleet's edge: the link to stage1's port pair for ``--edge-id``, or without one the first pair whose
    connections stage1 admits (a taken one refuses, `splitrl.transport.gate`; the search goes round the
    edges, after a random pause, until ``--start-timeout``: edges that start together do not take turns
    refusing each other forever). Returns (the link, the edge's id)."""
    if options.edge_id >= 0:
        where = slot_endpoint(connect, options.edge_id)
        return open_link(options, where, bind=False, peer=f"stage1 at {where}"), options.edge_id
    if not options.heartbeat:
        raise SettingsError("a fleet's stage0 without --edge-id finds a free place by stage1's refusals, which need "
                            "--heartbeat > 0: give --edge-id or a heartbeat")
    deadline = time.monotonic() + options.start_timeout
    rng = random.Random()
    taken: set[int] = set()
    slot = 0
    while True:
        where = slot_endpoint(connect, slot)
        link = open_link(options, where, bind=False, peer=f"stage1 at {where}")
        try:
            if link.admitted(max(0.1, deadline - time.monotonic())):
                return link, slot
        except TransportTimeout:
            link.close()
            if not taken:
                raise
            raise TransportTimeout(f"every edge's place at stage1 at {connect} is taken (--edges {edges}; tried "
                                   f"for {options.start_timeout:g} s)") from None
        except BaseException:
            link.close()
            raise
        link.close()
        if slot not in taken:
            log.info("[stage0] edge %d of stage1 at %s is taken; trying the others", slot, connect)
            taken.add(slot)
        if time.monotonic() >= deadline:
            raise TransportTimeout(f"every edge's place at stage1 at {connect} is taken (--edges {edges}; tried for "
                                   f"{options.start_timeout:g} s)")
        slot = (slot + 1) % edges
        time.sleep(rng.uniform(0.0, 0.5))


def run_stage0(settings: TrainSettings, options: RunOptions, connect: str) -> list[dict[str, Any]]:
    check_exposure(options, connect, bind=False)
    spec, run_log = prepare(settings, options, STAGE0)
    edges = settings.schedule.edges
    try:
        if edges > 1:
            log.info("[stage0] joining the fleet of stage1 at %s", connect)
            link, edge_id = join_fleet(options, connect, edges)
            log.info("[stage0] edge %d of %d", edge_id, edges)
        else:
            edge_id = 0
            log.info("[stage0] connecting to stage1 at %s", connect)
            link = open_link(options, connect, bind=False, peer=f"stage1 at {connect}")
        with link:
            edge = make_edge(settings, spec, run_log, options, edge_id)
            return serve_stage0(edge, link, checkpoint_every=options.checkpoint_every,
                                start_timeout=options.start_timeout, resume=bool(options.resume),
                                evaluation=make_evaluation(settings, spec, options))
    finally:
        run_log.close()


def serve_fleet(learner: Learner, links: list[Transport], settings: TrainSettings, run_log: RunLog | None = None, *,
                start_timeout: float | None = None, min_edges: int = 0, rejoin: float = 0.0,
                act_wait: float | None = None, resume: bool = False, first: int = 0) -> int:
    """Stage1 of a fleet: the edges' hellos (edge first + g on ``links[g]``; all of them, or ``min_edges``), then
    `fleet.stage1_loop` until they close (`fleet.Roster`: edges that fail are dropped, edges that come join).
    ``resume``: from the newest iteration stage1 and every edge that came have a checkpoint of
    (`Roster.resume`). Of several learners (``learner.learners``), this one serves the edges from ``first``."""
    try:
        exchange = learner_exchange(learner)
        roster = fleet.Roster(links, settings.shared(), min_edges, rejoin, first=first,
                              total=settings.schedule.edges, learners=learner.learners)
        ours = checkpoint_iterations(run_log.dir, STAGE1) if resume and run_log is not None else []
        if resume:
            roster.answer_extra = {"checkpoints": ours}
        roster.start(start_timeout if start_timeout is not None else RunOptions().start_timeout)
        if resume:
            iteration = roster.resume(ours)
            if iteration:
                assert run_log is not None
                state = load_checkpoint(run_log.dir, STAGE1, iteration)
                learner.load_state_dict(state)
                exchange.load_state_dict(state["exchange"])
            log.info("[stage1] resuming the fleet after iteration %d", iteration)
        served = fleet.stage1_loop(learner, exchange, roster, run_log, act_wait)
    except BaseException as exc:
        for link in links:
            link.abort(f"stage1 failed: {type(exc).__name__}: {exc}")
        raise
    log.info("[stage1] the fleet's edges closed the session after iteration %d", served)
    return served


def run_fleet_stage1(settings: TrainSettings, options: RunOptions, bind: str, spec: EnvSpec, run_log: RunLog,
                     learners: Learners) -> int:
    learner = make_learner(settings, spec)
    learner.learners = learners
    ids = edge_range(settings.schedule.edges, learners.world, learners.rank)
    links: list[Transport] = []
    try:
        for k in ids:
            links.append(open_link(options, slot_endpoint(bind, k), bind=True, peer=f"edge {k}"))
        log.info("[stage1] listening for %s on %s (edge k: port + 2k)", f"{len(links)} edges" if learners.alone else
                 f"edges {ids.start} .. {ids.stop - 1} of {settings.schedule.edges}", links[0].endpoint)
        return serve_fleet(learner, links, settings, run_log, start_timeout=options.start_timeout,
                           min_edges=options.min_edges if learners.alone else 0,  # 0: all of this one's edges
                           rejoin=options.rejoin,
                           act_wait=options.act_wait_seconds(), resume=bool(options.resume), first=ids.start)
    finally:
        for link in links:
            link.close()


def join_learners(settings: TrainSettings, options: RunOptions) -> tuple[Learners, RunOptions]:
    """This stage1's place among the learners ``torchrun`` started (one learner without it), and its options: a
    learner r > 0 keeps its run in RUN_DIR/learner-r (each learner checkpoints the heads it holds, the same on
    every learner, and resumes from its own directory)."""
    base = options.resume or options.run_dir
    if Learners.world_size(options.learners) > 1 and not base:  # each would choose runs/<time>-<env>, alike or not
        raise SettingsError("several learners need --run-dir RUN_DIR (or --resume RUN_DIR): learner 0 keeps its run "
                            "there, learner r > 0 in RUN_DIR/learner-r")
    # The learners meet after every rollout: one may wait for another's slowest edge, each of whose steps may
    # take --timeout. So an exchange waits at most what a rollout and a minibatch can take.
    learners = Learners.from_environment(options.start_timeout + (settings.ppo.num_steps + 2) * options.timeout,
                                         options.learners)
    if learners.alone:
        return learners, options
    options = dataclasses.replace(options, learners=learners.world)  # checked with the settings (`prepare`)
    try:
        learners.agree([settings.shared(), bool(options.resume), options.transport], "their settings")
    except BaseException:
        learners.close()
        raise
    if learners.rank:
        own = str(Path(base) / f"learner-{learners.rank}")
        options = dataclasses.replace(options, run_dir=own, resume=own if options.resume else "")
    return learners, options


def run_stage1(settings: TrainSettings, options: RunOptions, bind: str) -> int:
    check_exposure(options, bind, bind=True)
    learners, options = join_learners(settings, options)
    try:
        spec, run_log = prepare(settings, options, STAGE1)
        if settings.schedule.edges > 1 or not learners.alone:
            return run_fleet_stage1(settings, options, bind, spec, run_log, learners)
    finally:
        learners.close()
    learner = make_learner(settings, spec)
    with open_link(options, bind, bind=True, peer="stage0") as link:
        log.info("[stage1] listening on %s (%s)", link.endpoint, options.transport)
        resume, start_timeout, rejoining = bool(options.resume), options.start_timeout, False
        while True:
            try:
                return serve_stage1(learner, link, run_log, start_timeout=start_timeout, resume=resume)
            except (PeerGone, HandshakeError) as exc:
                if isinstance(exc, PeerGone) and options.rejoin and link.session is not None:
                    # The iteration in progress is lost with stage0; both go on from their newest common checkpoint.
                    log.warning("[stage1] %s; waiting up to %.0f s for stage0 to rejoin (restarted with --resume %s)",
                                exc, options.rejoin, run_log.dir)
                elif isinstance(exc, HandshakeError) and rejoining:
                    log.warning("[stage1] refused a stage0 that cannot rejoin (%s); still waiting up to %.0f s",
                                exc, options.rejoin)
                else:
                    raise
                link.new_session()
                learner = make_learner(settings, spec)
                resume, start_timeout, rejoining = True, options.rejoin, True


def train_twin(settings: TrainSettings, options: RunOptions) -> list[dict[str, Any]]:
    """Both stages in this process over an in-process link: the no-network baseline."""
    if settings.schedule.edges > 1:
        raise SettingsError("the twin runs one edge: a fleet (--edges > 1) trains as one edge with every edge's envs "
                            "in a rollout group each (--num-envs N x E --rollout-groups N), or split with "
                            "`splitrl run --edges N`")
    spec, run_log = prepare(settings, options, "twin")
    learner = make_learner(settings, spec)
    edge = make_edge(settings, spec, run_log, options)
    link0, link1 = LocalTransport.pair(STAGE0, STAGE1, limits=LIMITS, timeout=options.timeout)
    failure: list[BaseException] = []

    def stage1() -> None:
        try:
            serve_stage1(learner, link1, run_log, start_timeout=options.start_timeout, resume=bool(options.resume))
        except BaseException as exc:  # reported by the main thread, which stage0's abort wakes
            failure.append(exc)

    thread = torch_thread(stage1, "stage1")
    thread.start()
    try:
        records = serve_stage0(edge, link0, checkpoint_every=options.checkpoint_every,
                               start_timeout=options.start_timeout, resume=bool(options.resume),
                               evaluation=make_evaluation(settings, spec, options))
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
    finally:
        run_log.close()
    thread.join(timeout=options.timeout)
    if failure:
        raise failure[0]
    if thread.is_alive():
        raise RuntimeError(f"stage1's thread did not finish within {options.timeout:g} s of stage0's close")
    return records
