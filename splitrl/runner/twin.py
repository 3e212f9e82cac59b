"""Both stages in one process (the twin): the no-network baseline.

The twin builds the same `Edge` and `Learner` and runs the same schedule over an in-process link
(`LocalTransport`), stage1's loop on a thread of its own; with the same seed it computes what the split
run computes, bit for bit.
"""

from __future__ import annotations

import logging
from typing import Any

from ..schedule.common import torch_thread
from ..settings import RunOptions, SettingsError, TrainSettings
from ..stages import LIMITS, STAGE0, STAGE1
from ..transport import PeerAbort, TransportTimeout
from ..transport.local import LocalTransport
from . import build
from .rundir import prepare
from .stage0 import serve_stage0
from .stage1 import serve_stage1

__all__ = ["train_twin"]

log = logging.getLogger(__name__)


def train_twin(settings: TrainSettings, options: RunOptions) -> list[dict[str, Any]]:
    """Both stages in this process over an in-process link: the no-network baseline."""
    if settings.schedule.edges > 1:
        raise SettingsError("the twin runs one edge: a fleet (--edges > 1) trains as one edge with every edge's envs "
                            "in a rollout group each (--num-envs N x E --rollout-groups N), or split with "
                            "`splitrl run --edges N`")
    settings, spec, run_log = prepare(settings, options, "twin")
    learner = build.make_learner(settings, spec, options)
    edge = build.make_edge(settings, spec, run_log, options)
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
                               evaluation=build.make_evaluation(settings, spec, options, run_log.dir))
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
