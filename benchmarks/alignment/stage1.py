"""Stage1's side of the probe: hooks on the twin's `Learner` that record the version its heads act with at each
step and what it trains on; (b) to (f) are checked as it begins and ends training an iteration."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .checks import check_behaviour, check_outcomes, check_rescore, check_start, check_training, check_versions
from .errors import Alarm
from .plants import plant
from .record import Record
from .summary import Tally

__all__ = ["LearnerWatch"]

STORED = ("actions", "logprobs", "values", "rewards", "terminated", "truncated", "final_values")
"""The train buffer's rows that must not change while the slot trains (with the slot's versions, last values
and stored features)."""


class LearnerWatch:
    """Wraps methods of one Learner; each wrapper records, calls the original and checks where the data is
    whole."""

    HOOKS = ("act_groups", "end_rollout", "begin_training", "loss", "optimizer_step", "publish")

    def __init__(self, rec: Record, tally: Tally, alarm: Alarm) -> None:
        self.rec, self.tally, self.alarm = rec, tally, alarm
        self.run, self.training = rec.run, rec.training["stage1"]
        self.learner: Any = None
        self.slot = 0
        """The rollout slot being trained on."""

    def watch(self, learner: Any, planted: str | None) -> None:
        """Freeze and register version 0, plant stage1's bug if it is one, then wrap ``learner``'s methods."""
        self.learner = learner
        self.rec.versions.freeze("stage1", 0, learner.heads)
        if learner.acting is not learner.heads:
            self.rec.versions.register("stage1", learner.acting, 0)
        plant(planted, "stage1", learner)
        for name in self.HOOKS:
            setattr(learner, name, self.alarm.guard(getattr(self, f"_{name}")(getattr(learner, name))))

    def _version(self, where: tuple[int, str]) -> int:
        learner = self.learner
        return self.rec.versions.version_of("stage1", learner.acting, learner.heads, learner.iteration, where)

    def _act_groups(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def act_groups(steps: list[tuple[int, int, Any]], order_free: bool = False) -> Any:
            i = self.learner.iteration
            version = self._version((i, f"(t={steps[0][1]}, group {steps[0][0]})"))
            for g, t, _ in steps:
                self.rec.s1_steps[(i, t, g)] = version
            return original(steps, order_free)
        return act_groups

    def _end_rollout(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def end_rollout(msg: Any, g: int = 0) -> Any:
            i = self.learner.iteration
            self.rec.s1_ends[(i, g)] = self._version((i, f"rollout_end of group {g}"))
            return original(msg, g)
        return end_rollout

    def _begin_training(self, original: Callable[[int], Any]) -> Callable[[int], Any]:
        def begin_training(iteration: int) -> Any:
            schedule = original(iteration)
            rec, learner, i = self.rec, self.learner, iteration
            slot = next(k for k, b in enumerate(learner.rollouts.buffers.items) if b is learner.train_buffer)
            check_start(rec, "stage1", i, learner.heads)
            check_versions(rec, self.tally, i, learner.rollouts.versions.items[slot])
            check_outcomes(rec, i, learner.train_buffer, learner.heads.wire_action)
            check_behaviour(rec, self.tally, i, learner, slot)
            if self.run.settings.schedule.rescore:
                check_rescore(rec, self.tally, i, learner, slot)
            buf = learner.train_buffer
            rows = {name: getattr(buf, name).clone() for name in STORED}
            rows["versions"] = learner.rollouts.versions.items[slot].clone()
            rows["last_values"] = learner.rollouts.last_values.items[slot].clone()
            if learner.rollouts.inputs is not None:
                rows["inputs"] = learner.rollouts.inputs.items[slot].clone()
            self.slot = slot
            self.training.begin(i, schedule, self.run.per_iteration, rows)
            self.tally.checked["stage1 rollouts"] += 1
            return schedule
        return begin_training

    def _loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def loss(idx: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.training.parts[self.learner.train_iteration].append(idx.clone())
            return original(idx, *args, **kwargs)
        return loss

    def _optimizer_step(self, original: Callable[[], None]) -> Callable[[], None]:
        def optimizer_step() -> None:
            original()
            epoch_end, done = self.training.stepped()
            if epoch_end is not None:  # an epoch's end within the iteration
                self.rec.versions.freeze("stage1", epoch_end, self.learner.heads)
            if done:
                i = self.learner.train_iteration
                check_training(self.rec, i, self.learner, self.slot, self.training.snapshot)
                self.rec.versions.freeze("stage1", i * self.run.per_iteration, self.learner.heads)
                self.tally.checked["stage1 trainings"] += 1
        return optimizer_step

    def _publish(self, original: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
        def publish(*versions: list[int]) -> torch.nn.Module:
            with self.alarm.cond:
                heads = original(*versions)
                for version in versions[0] if versions else [self.learner.train_iteration * self.run.per_iteration]:
                    self.rec.versions.register("stage1", heads, version)
            return heads
        return publish
