"""Entry points: each stage as a process, and both in one process (the twin).

The twin and the split run build the same `Stage0` and `Stage1` objects; only
the link differs (`LocalTransport` versus `ZmqTransport`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..envs import EnvSpec, inspect_env
from ..settings import RunOptions, TrainSettings
from ..transport import TcpTransport, Transport, ZmqTransport
from ..transport.local import LocalTransport
from .protocol import LIMITS, STAGE0, STAGE1
from ..runs import RunLog, default_run_dir
from .stage0 import Stage0
from .stage1 import Stage1, Stage1Server

__all__ = ["prepare", "train_twin", "run_stage0", "run_stage1"]

log = logging.getLogger(__name__)


def prepare(settings: TrainSettings, options: RunOptions, role: str) -> tuple[EnvSpec, RunLog]:
    """Check everything before any socket opens; set threads; write config.json."""
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


def train_twin(settings: TrainSettings, options: RunOptions) -> list[dict[str, Any]]:
    """Both stages in this process over an in-process link: the no-network baseline."""
    spec, run_log = prepare(settings, options, "twin")
    stage1 = Stage1(settings, spec, run_log)
    stage0 = Stage0(settings, spec, run_log, checkpoint_every=options.checkpoint_every)
    link0, link1 = LocalTransport.pair(STAGE0, STAGE1, limits=LIMITS)
    server = Stage1Server(stage1, link1)
    link0.pump = server.serve_one
    records = stage0.run(link0)
    server.serve_one()  # the close
    return records


def open_link(options: RunOptions, endpoint: str, *, bind: bool, peer: str) -> Transport:
    """The link to the other stage, as chosen by ``--transport``."""
    if options.transport == "torch-rpc":
        from ..transport.torch_rpc import TorchRpcTransport  # imports torch.distributed: only when asked

        cls: type[Transport] = TorchRpcTransport
    else:
        cls = {"zmq": ZmqTransport, "tcp": TcpTransport}[options.transport]
    return cls(endpoint, bind=bind, timeout=options.timeout, limits=LIMITS, name=peer)


def run_stage0(settings: TrainSettings, options: RunOptions, connect: str) -> list[dict[str, Any]]:
    spec, run_log = prepare(settings, options, STAGE0)
    stage0 = Stage0(settings, spec, run_log, checkpoint_every=options.checkpoint_every)
    with open_link(options, connect, bind=False, peer=f"stage1 at {connect}") as link:
        log.info("[stage0] connecting to stage1 at %s", connect)
        return stage0.run(link, start_timeout=options.start_timeout)


def run_stage1(settings: TrainSettings, options: RunOptions, bind: str) -> int:
    spec, run_log = prepare(settings, options, STAGE1)
    stage1 = Stage1(settings, spec, run_log)
    with open_link(options, bind, bind=True, peer="stage0") as link:
        log.info("[stage1] listening on %s (%s)", link.endpoint, options.transport)
        return Stage1Server(stage1, link).serve(start_timeout=options.start_timeout, timeout=options.timeout)
