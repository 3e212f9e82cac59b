"""Deliberate bugs, one at a time, to show that the check that should catch each does."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

__all__ = ["PLANTS", "plant"]

PLANTS = {
    "obs-late": ("a", "stage0 stores each group's observation one step late (the features sent are right)"),
    "outcome-late": ("b", "stage1 stores each outcome one step late"),
    "adopt-late": ("c", "stage1 acts with the heads it had for one step after each swap, storing the new version"),
    "version-tag": ("d", "stage0 tags each step with the version before the one it encodes with"),
    "reshuffle": ("e", "stage1 takes each epoch's minibatches in reverse order"),
    "rescore-stale": ("f", "stage0 scores the rollout again with the encoder it started with, not the one that trains"),
}
"""Deliberate bugs, by name: (the invariant that must catch it, what it does)."""


def plant(name: str | None, stage: str, obj: Any) -> None:
    """Corrupt ``obj`` (stage0's Edge or stage1's Learner) with the bug ``name``, if it is this stage's."""
    if name is not None and PLANT_STAGES[name][0] == stage:
        PLANT_STAGES[name][1](obj)


def _plant_obs_late(edge: Any) -> None:
    observe, last = edge.observe, {}

    def late_observe(t: int, g: int = 0) -> Any:
        out = observe(t, g)
        rows = edge.groups.slices[g]
        now = edge.obs[t, rows].clone()
        if t > 0:
            edge.obs[t, rows] = last[g]
        last[g] = now
        return out

    edge.observe = late_observe


def _plant_version_tag(edge: Any) -> None:
    adopt = edge.adopt
    edge.adopt = lambda *version: max(adopt(*version) - 1, 0)


def _plant_rescore_stale(edge: Any) -> None:
    first = copy.deepcopy(edge.net).requires_grad_(False)

    def stale(idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return first(edge.flat_obs[idx])

    edge.features_now = stale


def _plant_outcome_late(learner: Any) -> None:
    record = learner.rollouts.record_outcomes
    last = learner.settings.ppo.num_steps - 1
    learner.rollouts.record_outcomes = lambda iteration, outcomes: record(
        iteration, [(min(step + 1, last), g, o) for step, g, o in outcomes])


def _plant_adopt_late(learner: Any) -> None:
    act_groups, before = learner.act_groups, [learner.acting]

    def late_act_groups(steps: list[tuple[int, int, Any]], order_free: bool = False) -> Any:
        now = learner.acting
        if now is before[0]:
            return act_groups(steps, order_free)
        learner.policy.acting, before[0] = before[0], now
        try:
            return act_groups(steps, order_free)
        finally:
            learner.policy.acting = now

    learner.act_groups = late_act_groups


def _plant_reshuffle(learner: Any) -> None:
    begin_training = learner.begin_training
    learner.begin_training = lambda iteration: [epoch[::-1] for epoch in begin_training(iteration)]


PLANT_STAGES: dict[str, tuple[str, Callable[[Any], None]]] = {
    "obs-late": ("stage0", _plant_obs_late), "version-tag": ("stage0", _plant_version_tag),
    "rescore-stale": ("stage0", _plant_rescore_stale), "outcome-late": ("stage1", _plant_outcome_late),
    "adopt-late": ("stage1", _plant_adopt_late), "reshuffle": ("stage1", _plant_reshuffle),
}
"""Each planted bug's stage and what plants it (`PLANTS` says what it does)."""
