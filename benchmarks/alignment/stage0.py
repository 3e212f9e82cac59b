"""Stage0's side of the probe: hooks on the twin's `Edge` that record its env steps, the version it tags,
encodes with and publishes at each step, and what it trains on; (a) is checked as training begins."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .checks import check_observations, check_observations_kept, check_start
from .errors import Alarm
from .hold import Hold
from .plants import plant
from .record import Record
from .summary import Tally

__all__ = ["EdgeWatch"]


class EdgeWatch:
    """Wraps methods of one Edge; each wrapper records, calls the original and checks where the data is whole."""

    HOOKS = ("open_envs", "adopt", "observe", "end_rollout", "begin_training", "forward", "optimizer_step", "publish")

    def __init__(self, rec: Record, tally: Tally, alarm: Alarm, hold: Hold | None) -> None:
        self.rec, self.tally, self.alarm, self.hold = rec, tally, alarm, hold
        self.run, self.training = rec.run, rec.training["stage0"]
        self.edge: Any = None

    def watch(self, edge: Any, planted: str | None) -> None:
        """Freeze and register version 0, plant stage0's bug if it is one, then wrap ``edge``'s methods."""
        self.edge = edge
        self.rec.versions.freeze("stage0", 0, edge.net)
        if edge.acting is not edge.net:
            self.rec.versions.register("stage0", edge.acting, 0)
        plant(planted, "stage0", edge)
        for name in self.HOOKS:
            setattr(edge, name, self.alarm.guard(getattr(self, f"_{name}")(getattr(edge, name))))

    def _version(self, where: tuple[int, str]) -> int:
        edge = self.edge
        return self.rec.versions.version_of("stage0", edge.acting, edge.net, edge.iteration, where)

    def _open_envs(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def open_envs() -> None:
            original()
            self.rec.env.open(self.edge)
        return open_envs

    def _adopt(self, original: Callable[..., int]) -> Callable[..., int]:
        def adopt(*version: int) -> int:
            if self.hold is not None:
                self.hold.adopting(self.edge.iteration)
            self.rec.tag = original(*version)
            return self.rec.tag
        return adopt

    def _observe(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def observe(t: int, g: int = 0) -> Any:
            rec, i = self.rec, self.edge.iteration
            version = self._version((i, f"(t={t}, group {g})"))
            with self.alarm.cond:
                rec.s0_steps[(i, t, g)] = (rec.tag, version)
                rec.tag = None
                self.alarm.cond.notify_all()
            return original(t, g)
        return observe

    def _end_rollout(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def end_rollout(g: int = 0) -> Any:
            rec, i = self.rec, self.edge.iteration
            rec.s0_ends[(i, g)] = (rec.tag, self._version((i, f"rollout_end of group {g}")))
            rec.tag = None
            return original(g)
        return end_rollout

    def _begin_training(self, original: Callable[[int], Any]) -> Callable[[int], Any]:
        def begin_training(iteration: int) -> Any:
            schedule = original(iteration)
            edge, i = self.edge, iteration
            check_start(self.rec, "stage0", i, edge.net)
            check_observations(self.rec, i, edge.flat_obs)
            self.training.begin(i, schedule, self.run.per_iteration, {"obs": edge.flat_obs.clone()})
            self.tally.checked["stage0 rollouts"] += 1
            return schedule
        return begin_training

    def _forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(idx: torch.Tensor) -> Any:
            self.training.parts[self.edge.train_iteration].append(idx.clone())
            return original(idx)
        return forward

    def _optimizer_step(self, original: Callable[[], None]) -> Callable[[], None]:
        def optimizer_step() -> None:
            original()
            epoch_end, done = self.training.stepped()
            if epoch_end is not None:  # an epoch's end within the iteration
                self.rec.versions.freeze("stage0", epoch_end, self.edge.net)
            if done:  # the iteration's training is done: version i is what it left
                i = self.edge.train_iteration
                check_observations_kept(self.rec, i, self.edge.flat_obs, self.training.snapshot.pop("obs"))
                self.rec.versions.freeze("stage0", i * self.run.per_iteration, self.edge.net)
                self.tally.checked["stage0 trainings"] += 1
        return optimizer_step

    def _publish(self, original: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
        def publish(*versions: list[int]) -> torch.nn.Module:
            i = self.edge.train_iteration
            if self.hold is not None:
                self.hold.publishing(i)
            with self.alarm.cond:
                module = original(*versions)
                for version in versions[0] if versions else [i * self.run.per_iteration]:
                    self.rec.versions.register("stage0", module, version)
                    if self.hold is not None:
                        self.hold.published.add(version)
                self.alarm.cond.notify_all()
            return module
        return publish
