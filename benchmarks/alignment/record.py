"""What happened in a run, kept where it happened, for the checks to read.

The env steps at the vector env's boundary, every policy version's layers as training left them (and the acting
copies published from them), the version each stage tagged, encoded and acted with at each step, and the
minibatches each stage trained on.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from splitrl.envs import to_chw

from .errors import broken
from .run import Run

__all__ = ["EnvRecord", "EnvStep", "Record", "TrainingLog", "Versions", "weights_differ"]


@dataclass
class EnvStep:
    """One step of one env group as the vector env saw it."""

    action: np.ndarray
    obs: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_obs: dict[int, np.ndarray]
    """The real last observation of each env (index within the group) whose episode was truncated."""


class EnvRecord:
    """Each env group's observations and steps from its reset on, as stage0's vector envs gave and took them."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.spec: Any = None
        """The env's spec: how the heads' actions map to the env's."""
        self.groups: list[list[int]] = []
        """Each env group's env indices, as stage0 cut them (`Edge.set_groups`)."""
        self.reset_obs: dict[int, np.ndarray] = {}
        self.steps: dict[int, list[EnvStep]] = {}

    def open(self, edge: Any) -> None:
        """Start recording the envs ``edge`` has just opened: their first observations, then every step."""
        self.spec = edge.spec
        self.groups = [[int(e) for e in rows] for rows in edge.groups.rows]
        for g, env in enumerate(edge.envs.envs):
            self.reset_obs[g] = np.array(edge.envs.next_obs[g], copy=True)
            self.steps[g] = []
            env.step = self._recording_step(g, env.step)

    def _recording_step(self, g: int, step: Callable[..., Any]) -> Callable[..., Any]:
        def recording_step(actions: np.ndarray) -> Any:
            out = step(actions)
            obs, reward, terminated, truncated, info = out
            terminated, truncated = np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool)
            final = {int(j): np.array(info["final_obs"][j], copy=True) for j in np.flatnonzero(truncated & ~terminated)}
            self.steps[g].append(EnvStep(np.array(actions, copy=True), np.array(obs, copy=True),
                                         np.asarray(reward).astype(np.float32), terminated.copy(),
                                         truncated.copy(), final))
            return out
        return recording_step

    def obs(self, g: int, k: int) -> torch.Tensor:
        """Group ``g``'s observation before its env step ``k`` (counted over the run), channels first."""
        obs = self.reset_obs[g] if k == 0 else self.steps[g][k - 1].obs
        return torch.as_tensor(to_chw(obs, self.run.settings.env.image_pipeline[1] > 1))

    def rollout_obs(self, iteration: int) -> torch.Tensor:
        """The env's observations of the rollout of ``iteration``, (T, N, C, H, W)."""
        settings = self.run.settings
        T = settings.ppo.num_steps
        first = [self.obs(g, (iteration - 1) * T) for g in range(len(self.groups))]
        out = torch.empty((T, settings.env.num_envs) + tuple(first[0].shape[1:]), dtype=torch.uint8)
        for g, rows in enumerate(self.groups):
            for t in range(T):
                out[t, rows] = self.obs(g, (iteration - 1) * T + t)
        return out


def weights_differ(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    """The first tensor whose values differ between two modules of one architecture, said with its numbers."""
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        if not torch.equal(sa[name], sb[name]):
            return f"{name} differs by up to {float((sa[name] - sb[name]).abs().max()):.3g}"
    return None


class Versions:
    """Every policy version's layers as training left them (what each sample's version must reproduce), and each
    acting copy a stage could act with."""

    def __init__(self, run: Run, lock: threading.Condition) -> None:
        self.run = run
        self.lock = lock
        """Held while a copy is published and registered, so no stage looks it up in between."""
        self.encoders: dict[int, torch.nn.Module] = {}
        self.heads: dict[int, torch.nn.Module] = {}
        self.acting: dict[str, dict[int, tuple[torch.nn.Module, int]]] = {"stage0": {}, "stage1": {}}
        """Each acting copy a stage could act with, by id: (the module, its version)."""

    def trained(self, stage: str) -> dict[int, torch.nn.Module]:
        """The frozen layers of ``stage`` (its encoder or its heads), by version."""
        return self.encoders if stage == "stage0" else self.heads

    def freeze(self, stage: str, version: int, module: torch.nn.Module) -> None:
        """Keep a copy of ``module`` as training left it at ``version``."""
        self.trained(stage)[version] = copy.deepcopy(module).requires_grad_(False)

    def register(self, stage: str, module: torch.nn.Module, version: int) -> None:
        """Note ``module`` as ``stage``'s acting copy of ``version``; (d): it must be what training left."""
        frozen = self.trained(stage).get(version)
        differs = "no trained weights of that version" if frozen is None else weights_differ(module, frozen)
        if differs:
            raise broken("d", "versions", version, "the publish",
                         f"{stage}'s acting copy of version {version} is not what training left: {differs}")
        self.acting[stage][id(module)] = (module, version)

    def version_of(self, stage: str, module: torch.nn.Module, live: torch.nn.Module, iteration: int,
                   where: tuple[int, str]) -> int:
        """The version of the weights ``module`` holds: the trained layers themselves (the pipelined schedule
        acts with them, trained iteration - 1 times), else a registered acting copy."""
        if module is live:
            return (iteration - 1) * self.run.per_iteration
        with self.lock:  # a copy is registered under this lock before its publish returns
            entry = self.acting[stage].get(id(module))
        if entry is None or entry[0] is not module:
            raise broken("d", "versions", where[0], where[1], f"{stage} acted with weights of no published version")
        return entry[1]

    def behaviour(self, version: int, obs: torch.Tensor,
                  actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features, log-prob, value) of ``version``'s encoder and heads on ``obs`` and ``actions``."""
        heads = self.heads[version]
        with torch.no_grad():
            features = self.encoders[version](obs)
            mean, value = heads.outputs(features)
            return features, heads.evaluate(mean, value, actions)[1], value

    def value(self, version: int, obs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.heads[version].get_value(self.encoders[version](obs))


class TrainingLog:
    """What one stage trained on: each iteration's minibatch schedule and the parts it took, in order, and where
    its optimizer steps are in the iteration."""

    def __init__(self) -> None:
        self.schedules: dict[int, list[list[torch.Tensor]]] = {}
        self.parts: dict[int, list[torch.Tensor]] = {}
        """Sample indices the stage actually trained on, per iteration, in order."""
        self.steps_left = 0
        self.epoch_ends: dict[int, int] = {}
        """Steps left (as `steps_left` counts them) after each epoch whose end is a version -> that version."""
        self.snapshot: dict[str, torch.Tensor] = {}
        """The trained rows as training began, to compare with as it ends."""

    def begin(self, i: int, schedule: list[list[torch.Tensor]], per_iteration: int,
              snapshot: dict[str, torch.Tensor]) -> None:
        """Iteration ``i`` starts training on ``schedule``: with --publish epoch every epoch's end is a version,
        (i - 1) P + e + 1; otherwise the iteration's, i."""
        self.snapshot = snapshot
        self.schedules[i] = schedule
        self.parts[i] = []
        P, left, self.epoch_ends = per_iteration, sum(len(epoch) for epoch in schedule), {}
        self.steps_left = left
        for e, epoch in enumerate(schedule):
            left -= len(epoch)
            if P > 1 or left == 0:
                self.epoch_ends[left] = (i - 1) * P + e + 1 if P > 1 else i

    def stepped(self) -> tuple[int | None, bool]:
        """Count one optimizer step: (the version it ends if it ends an epoch within the iteration, whether it
        ends the iteration's training)."""
        self.steps_left -= 1
        version = self.epoch_ends.get(self.steps_left)
        return (version if self.steps_left > 0 else None), self.steps_left == 0


@dataclass
class Record:
    """Everything the probe recorded of one run."""

    run: Run
    env: EnvRecord
    versions: Versions
    s0_steps: dict[tuple[int, int, int], tuple[int | None, int]] = field(default_factory=dict)
    """(iteration, t, g) -> (stage0's tag for the step, the version of the encoder that encoded it)."""
    s0_ends: dict[tuple[int, int], tuple[int | None, int]] = field(default_factory=dict)
    s1_steps: dict[tuple[int, int, int], int] = field(default_factory=dict)
    """(iteration, t, g) -> the version of the heads that acted on the step."""
    s1_ends: dict[tuple[int, int], int] = field(default_factory=dict)
    tag: int | None = None
    """The version stage0's last adopt returned, until the step it tags is recorded."""
    training: dict[str, TrainingLog] = field(default_factory=lambda: {"stage0": TrainingLog(),
                                                                      "stage1": TrainingLog()})

    @classmethod
    def new(cls, run: Run, lock: threading.Condition) -> Record:
        return cls(run, EnvRecord(run), Versions(run, lock))
