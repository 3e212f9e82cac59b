"""What a worker builds from the settings: the stages' compute objects, with as many rollout slots and acting
copies as the schedule needs, and the schedule that drives them."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from ..devices import resolve_device
from ..envs import EnvSpec
from ..runs import RunLog
from ..schedule import asynchronous, fleet, pipelined, sync
from ..settings import RunOptions, TrainSettings
from ..stages import Edge, Learner
from ..stages.evaluate import Evaluation

__all__ = ["SCHEDULES", "make_edge", "make_learner", "make_evaluation"]

SCHEDULES: dict[str, ModuleType] = {"sync": sync, "pipelined": pipelined, "async": asynchronous, "fleet": fleet}
"""``settings.schedule.mode`` -> the module whose ``stage0_open`` / ``stage1_open`` (the session's opening after
the hellos) and ``stage0_loop`` / ``stage1_loop`` (the iterations) run it."""


def make_edge(settings: TrainSettings, spec: EnvSpec, run_log: RunLog | None, options: RunOptions,
              edge: int = 0) -> Edge:
    """Stage0's compute (edge ``edge`` of a fleet), with as many rollout slots and acting copies as the schedule
    needs."""
    concurrent = settings.schedule.mode == "async"
    return Edge(settings, spec, run_log, vector=options.vector, env_nice=options.env_nice, acting_copy=concurrent,
                slots=settings.schedule.max_staleness + 1 if concurrent else 1, edge=edge,
                device=resolve_device(options.stage0_device), channels_last=options.channels_last)


def make_evaluation(settings: TrainSettings, spec: EnvSpec, options: RunOptions,
                    run_dir: str | Path | None = None) -> Evaluation | None:
    """Stage0's scoring during training, if ``--eval-every`` asks for it (on stage0's device); with
    ``--capture-video``, its videos in ``run_dir``/videos/."""
    if not options.eval_every:
        return None
    videos = Path(run_dir) / "videos" if options.capture_video and run_dir is not None else None
    return Evaluation(settings, spec, options.eval_every, options.eval_episodes, resolve_device(options.stage0_device),
                      video_dir=videos, video_every=options.video_every)


def make_learner(settings: TrainSettings, spec: EnvSpec, options: RunOptions | None = None) -> Learner:
    """Stage1's compute (on ``options``' stage1 device; default the CPU), with as many rollout slots and acting
    copies as the schedule needs; a fleet's learns as one edge with all the edges' envs
    (`TrainSettings.fleet_view`)."""
    concurrent, options = settings.schedule.mode == "async", options or RunOptions()
    return Learner(settings.fleet_view(), spec, acting_copy=concurrent,
                   slots=settings.schedule.max_staleness + 1 if concurrent else 1,
                   device=resolve_device(options.stage1_device), channels_last=options.channels_last)
