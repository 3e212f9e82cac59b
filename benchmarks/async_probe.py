"""Run the twin (`splitrl train`) with its stages watched, and check that what trains is what happened.

    python benchmarks/async_probe.py [--hold] [--plant NAME] -- TRAIN_ARGS...

The asynchronous schedule collects the next rollout while the last one trains,
with acting copies of the encoder and the heads swapped in flight. Nothing in a
run's metrics shows whether a sample's stored observation, outcome, behaviour
log-probability and version still belong together. This script builds the same
`Edge` and `Learner` as the twin (`splitrl.runner.build.make_edge` and
``make_learner``, patched), wraps methods of those two objects, records each env
step at the vector env's boundary and keeps a frozen copy of every policy
version as training leaves it. For every iteration it trains it checks:

(a) observations: stage0's stored observations are the env's at each (t, env);
(b) outcomes: stage1's stored reward / terminated / truncated are what the env
    returned for the action taken at t, and that action is the one stored at t;
(c) behaviour: each sample's stored log-probability and value (and its stored
    features, the bootstrap values) are what its recorded version's encoder and
    heads give on the stored observation and action; over the run, a neighbouring
    version must fail to match at least once, or the check could not tell;
(d) versions: stage0's tag, the encoder that encoded, the heads that acted and
    the stored version agree at each step and lag within the staleness bound;
    published copies equal the trained weights, and iteration i trains from
    version (i - 1) P on both stages, exactly (P versions an iteration: its E
    epochs with --publish epoch, where step t must also act with the pace's
    version (i - 2) E + floor(t E / T); else 1);
(e) training data: both stages train on the same minibatch indices, in the same
    order, and the trained slot's rows and versions do not change while it trains;
(f) with ``--rescore``: the baseline of the advantages and value targets and the
    proximal log-probabilities of lagging samples are version i - 1's (the network
    that starts training) on each sample's stored observation and action, and the
    value targets are GAE on that baseline with weights min(1, pi_{i-1} / mu).

The first broken invariant stops the run: a line naming it, the iteration, the
(t, env) and the numbers goes to stderr and the exit code is 1 (2: the probe
could not run). Otherwise one JSON line on stdout says what was checked.

``--hold`` (asynchronous, ``--max-staleness`` S >= 1) makes the largest lag
happen whatever the machine's timing, with condition waits, not sleeps: version
i is published only once the rollout of i + S has sent its first step, and that
rollout's second step waits for the publish. So every rollout after the S-th
starts at lag S and swaps versions in flight.

``--plant NAME`` corrupts one thing on purpose (`PLANTS`), to show the check that
should catch it does.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import splitrl
from splitrl.envs import to_chw
from splitrl.ppo import compute_gae

__all__ = ["PLANTS", "InvariantBroken", "Probe", "main"]

PLANTS = {
    "obs-late": ("a", "stage0 stores each group's observation one step late (the features sent are right)"),
    "outcome-late": ("b", "stage1 stores each outcome one step late"),
    "adopt-late": ("c", "stage1 acts with the heads it had for one step after each swap, storing the new version"),
    "version-tag": ("d", "stage0 tags each step with the version before the one it encodes with"),
    "reshuffle": ("e", "stage1 takes each epoch's minibatches in reverse order"),
    "rescore-stale": ("f", "stage0 scores the rollout again with the encoder it started with, not the one that trains"),
}
"""Deliberate bugs, by name: (the invariant that must catch it, what it does)."""

ATOL = RTOL = 1e-5
"""fp32 numbers recomputed in other batch shapes agree to this (|a - b| <= ATOL + RTOL |b|)."""

HOLD_TIMEOUT = 60.0
"""Seconds a ``--hold`` wait gives the other thread before the probe gives up (exit 2)."""


class InvariantBroken(Exception):
    """The first invariant the run broke; its message is the report."""


class ProbeError(Exception):
    """The probe could not do its job (settings it does not cover, a hold that timed out)."""


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


def _close(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs() <= ATOL + RTOL * b.abs()


def _frozen(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module).requires_grad_(False)


def _weights_differ(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    """The first tensor whose values differ between two modules of one architecture, said with its numbers."""
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        if not torch.equal(sa[name], sb[name]):
            return f"{name} differs by up to {float((sa[name] - sb[name]).abs().max()):.3g}"
    return None


class Probe:
    """Records both stages of one twin run and checks every iteration they train (see the module's doc)."""

    def __init__(self, hold: bool = False, plant: str | None = None) -> None:
        self.hold, self.plant = hold, plant
        self.failure: InvariantBroken | None = None
        self.cond = threading.Condition(threading.RLock())
        self.settings: Any = None
        self.edge: Any = None
        self.learner: Any = None
        self.groups: list[list[int]] = []
        """Each env group's env indices, as stage0 cut them (`Edge.set_groups`)."""
        self.slot = 0
        """Stage1's rollout slot being trained on."""
        self.reset_obs: dict[int, np.ndarray] = {}
        self.env_steps: dict[int, list[EnvStep]] = {}
        self.encoders: dict[int, torch.nn.Module] = {}
        self.heads: dict[int, torch.nn.Module] = {}
        """Every policy version's layers as training left them: what each sample's version must reproduce."""
        self.acting: dict[str, dict[int, tuple[torch.nn.Module, int]]] = {"stage0": {}, "stage1": {}}
        """Each acting copy a stage could act with, by id: (the module, its version)."""
        self.s0_steps: dict[tuple[int, int, int], tuple[int | None, int]] = {}
        """(iteration, t, g) -> (stage0's tag for the step, the version of the encoder that encoded it)."""
        self.s0_ends: dict[tuple[int, int], tuple[int | None, int]] = {}
        self.s1_steps: dict[tuple[int, int, int], int] = {}
        """(iteration, t, g) -> the version of the heads that acted on the step."""
        self.s1_ends: dict[tuple[int, int], int] = {}
        self.adopts: Counter[int] = Counter()
        self.published: set[int] = set()
        self.tag: int | None = None
        self.schedules: dict[str, dict[int, list[list[torch.Tensor]]]] = {"stage0": {}, "stage1": {}}
        self.parts: dict[str, dict[int, list[torch.Tensor]]] = {"stage0": {}, "stage1": {}}
        """Sample indices each stage actually trained on, per iteration, in order."""
        self.steps_left: dict[str, int] = {}
        self.epoch_ends: dict[str, dict[int, int]] = {}
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self.checked: Counter[str] = Counter()
        self.lags: Counter[int] = Counter()
        self.swaps = 0
        self.truncations = 0
        self.neighbour_tried = 0
        self.neighbour_differs = 0
        self.max_err = {"logprob": 0.0, "value": 0.0, "features": 0.0, "bootstrap": 0.0}

    # -- settings and shapes ------------------------------------------------------------------------------

    @property
    def asynchronous(self) -> bool:
        return self.settings.schedule.mode == "async"

    @property
    def per_iteration(self) -> int:
        """P: policy versions an iteration (its epochs with --publish epoch, else 1); version i * P is iteration
        i's end."""
        return self.settings.ppo.epochs if self.settings.schedule.publish == "epoch" else 1

    @property
    def bound(self) -> int:
        return self.settings.schedule.max_staleness if self.asynchronous else 0

    def take_settings(self, settings: Any) -> None:
        s = settings
        if s.schedule.mode not in ("async", "pipelined", "sync") or s.cut != "cnn" or s.bottleneck_train != "ppo" \
                or s.codecs.parsed_exchange().name != "features" or s.ppo.target_kl > 0:
            raise ProbeError("the probe covers one edge, --cut cnn, --exchange features, --bottleneck-train ppo "
                             "and no --target-kl")
        self.settings = s
        if self.hold and not (self.asynchronous and s.schedule.max_staleness >= 1):
            raise ProbeError("--hold needs --async and --max-staleness >= 1")
        if self.hold and self.per_iteration > 1:
            raise ProbeError("--hold needs --publish iteration (--publish epoch paces the rollout itself)")
        if self.plant in ("adopt-late", "version-tag") and not self.asynchronous:
            raise ProbeError(f"--plant {self.plant} needs --async (only its rollout swaps versions)")
        if self.plant == "rescore-stale" and not settings.schedule.rescore:
            raise ProbeError("--plant rescore-stale needs --rescore")

    def _fail(self, invariant: str, what: str, iteration: int, where: str, detail: str) -> None:
        error = InvariantBroken(f"async probe: invariant ({invariant}) {what} broken at iteration {iteration}, "
                                f"{where}: {detail}")
        with self.cond:
            if self.failure is None:
                self.failure = error
            self.cond.notify_all()
        raise error

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + HOLD_TIMEOUT
        with self.cond:
            while not ready():
                if self.failure is not None:
                    raise self.failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProbeError(f"--hold waited {HOLD_TIMEOUT:g} s for {what}")
                self.cond.wait(min(left, 0.5))

    def _version_of(self, stage: str, module: torch.nn.Module, live: torch.nn.Module, iteration: int,
                    where: tuple[int, str]) -> int:
        """The version of the weights ``module`` holds: the trained layers themselves (the pipelined schedule
        acts with them, trained iteration - 1 times), else a registered acting copy."""
        if module is live:
            return (iteration - 1) * self.per_iteration
        with self.cond:  # a copy is registered under this lock before its publish returns
            entry = self.acting[stage].get(id(module))
        if entry is None or entry[0] is not module:
            self._fail("d", "versions", where[0], where[1], f"{stage} acted with weights of no published version")
        return entry[1]

    def _register(self, stage: str, module: torch.nn.Module, version: int) -> None:
        frozen = (self.encoders if stage == "stage0" else self.heads).get(version)
        differs = "no trained weights of that version" if frozen is None else _weights_differ(module, frozen)
        if differs:
            self._fail("d", "versions", version, "the publish",
                       f"{stage}'s acting copy of version {version} is not what training left: {differs}")
        self.acting[stage][id(module)] = (module, version)

    def _freeze(self, store: dict[int, torch.nn.Module], version: int, module: torch.nn.Module) -> None:
        store[version] = _frozen(module)

    def _obs(self, g: int, k: int) -> torch.Tensor:
        """Group ``g``'s observation before its env step ``k`` (counted over the run), channels first."""
        obs = self.reset_obs[g] if k == 0 else self.env_steps[g][k - 1].obs
        return torch.as_tensor(to_chw(obs, self.settings.env.image_pipeline[1] > 1))

    def _rollout_obs(self, iteration: int) -> torch.Tensor:
        """The env's observations of the rollout of ``iteration``, (T, N, C, H, W)."""
        T = self.settings.ppo.num_steps
        first = [self._obs(g, (iteration - 1) * T) for g in range(len(self.groups))]
        out = torch.empty((T, self.settings.env.num_envs) + tuple(first[0].shape[1:]), dtype=torch.uint8)
        for g, rows in enumerate(self.groups):
            for t in range(T):
                out[t, rows] = self._obs(g, (iteration - 1) * T + t)
        return out

    # -- stage0 ------------------------------------------------------------------------------------------------

    def _plant(self, stage: str, obj: Any) -> None:
        """Corrupt ``obj`` (the Edge or the Learner) with the planted bug, if it is this stage's."""
        if self.plant is not None and PLANT_STAGES[self.plant][0] == stage:
            PLANT_STAGES[self.plant][1](obj)

    def watch_edge(self, edge: Any) -> None:
        self.edge = edge
        self._freeze(self.encoders, 0, edge.net)
        if edge.acting is not edge.net:
            self._register("stage0", edge.acting, 0)
        self._plant("stage0", edge)
        for name in ("open_envs", "adopt", "observe", "end_rollout", "begin_training", "forward", "optimizer_step",
                     "publish"):
            setattr(edge, name, getattr(self, f"_edge_{name}")(getattr(edge, name)))

    def _edge_open_envs(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def open_envs() -> None:
            original()
            edge = self.edge
            self.groups = [[int(e) for e in rows] for rows in edge.groups]
            for g, env in enumerate(edge.envs):
                self.reset_obs[g] = np.array(edge.next_obs[g], copy=True)
                self.env_steps[g] = []
                env.step = self._recording_step(g, env.step)
        return open_envs

    def _recording_step(self, g: int, step: Callable[..., Any]) -> Callable[..., Any]:
        def recording_step(actions: np.ndarray) -> Any:
            out = step(actions)
            obs, reward, terminated, truncated, info = out
            terminated, truncated = np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool)
            final = {int(j): np.array(info["final_obs"][j], copy=True) for j in np.flatnonzero(truncated & ~terminated)}
            self.env_steps[g].append(EnvStep(np.array(actions, copy=True), np.array(obs, copy=True),
                                             np.asarray(reward).astype(np.float32), terminated.copy(),
                                             truncated.copy(), final))
            return out
        return recording_step

    def _edge_adopt(self, original: Callable[..., int]) -> Callable[..., int]:
        def adopt(*version: int) -> int:
            j, S = self.edge.iteration, self.bound
            self.adopts[j] += 1
            if self.hold and self.adopts[j] == 2 and j - S >= 1:  # the rollout's second step: after the publish
                self._wait(lambda: j - S in self.published, f"version {j - S} to be published")
            self.tag = original(*version)
            return self.tag
        return adopt

    def _stage0_version(self, where: tuple[int, str]) -> int:
        edge = self.edge
        return self._version_of("stage0", edge.acting, edge.net, edge.iteration, where)

    def _edge_observe(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def observe(t: int, g: int = 0) -> Any:
            i = self.edge.iteration
            version = self._stage0_version((i, f"(t={t}, group {g})"))
            with self.cond:
                self.s0_steps[(i, t, g)] = (self.tag, version)
                self.tag = None
                self.cond.notify_all()
            return original(t, g)
        return observe

    def _edge_end_rollout(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def end_rollout(g: int = 0) -> Any:
            i = self.edge.iteration
            self.s0_ends[(i, g)] = (self.tag, self._stage0_version((i, f"rollout_end of group {g}")))
            self.tag = None
            return original(g)
        return end_rollout

    def _edge_begin_training(self, original: Callable[[int], Any]) -> Callable[[int], Any]:
        def begin_training(iteration: int) -> Any:
            schedule = original(iteration)
            edge, i = self.edge, iteration
            start = (i - 1) * self.per_iteration
            differs = _weights_differ(edge.net, self.encoders[start])
            if differs:
                self._fail("d", "versions", i, "the start of training",
                           f"stage0's encoder is not version {start} as training left it: {differs}")
            self._check_observations(i, edge.flat_obs)
            self.snapshots["stage0"] = {"obs": edge.flat_obs.clone()}
            self.schedules["stage0"][i] = schedule
            self.parts["stage0"][i] = []
            self.steps_left["stage0"] = sum(len(epoch) for epoch in schedule)
            self.epoch_ends["stage0"] = self._epoch_ends(i, schedule)
            self.checked["stage0 rollouts"] += 1
            return schedule
        return begin_training

    def _check_observations(self, i: int, flat_obs: torch.Tensor) -> None:
        """(a): the rows training forwards are the env's observations, (t, env) by (t, env)."""
        T, N = self.settings.ppo.num_steps, self.settings.env.num_envs
        expected = self._rollout_obs(i)
        stored = flat_obs.view((T, N) + tuple(flat_obs.shape[1:]))
        for t in range(T):
            for env in range(N):
                if torch.equal(stored[t, env], expected[t, env]):
                    continue
                diff = (stored[t, env].int() - expected[t, env].int()).abs()
                near = [f"the env's at t{d:+d}" for d in (-1, 1)
                        if 0 <= t + d < T and torch.equal(stored[t, env], expected[t + d, env])]
                self._fail("a", "observations", i, f"(t={t}, env={env})",
                           f"the stored observation differs from the env's in {int((diff > 0).sum())} of "
                           f"{diff.numel()} pixels (mean |diff| {float(diff.float().mean()):.3g})"
                           + (f"; it equals {near[0]}" if near else ""))

    def _edge_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(idx: torch.Tensor) -> Any:
            self.parts["stage0"][self.edge.train_iteration].append(idx.clone())
            return original(idx)
        return forward

    def _epoch_ends(self, i: int, schedule: list[list[torch.Tensor]]) -> dict[int, int]:
        """Steps left (as `steps_left` counts them) after each epoch whose end is a version -> that version: with
        --publish epoch every epoch's, (i - 1) P + e + 1; otherwise the iteration's, i."""
        P, left, ends = self.per_iteration, sum(len(epoch) for epoch in schedule), {}
        for e, epoch in enumerate(schedule):
            left -= len(epoch)
            if P > 1 or left == 0:
                ends[left] = (i - 1) * P + e + 1 if P > 1 else i
        return ends

    def _edge_optimizer_step(self, original: Callable[[], None]) -> Callable[[], None]:
        def optimizer_step() -> None:
            original()
            self.steps_left["stage0"] -= 1
            version = self.epoch_ends["stage0"].get(self.steps_left["stage0"])
            if version is not None and self.steps_left["stage0"] > 0:  # an epoch's end within the iteration
                self._freeze(self.encoders, version, self.edge.net)
            if self.steps_left["stage0"] == 0:  # the iteration's training is done: version i is what it left
                i = self.edge.train_iteration
                stored = self.edge.flat_obs
                before = self.snapshots.pop("stage0")["obs"]
                if not torch.equal(stored, before):
                    row = int((stored != before).reshape(len(stored), -1).any(1).nonzero()[0])
                    N = self.settings.env.num_envs
                    self._fail("e", "training data", i, f"(t={row // N}, env={row % N})",
                               "stage0's stored observation changed while it trained on it")
                self._freeze(self.encoders, i * self.per_iteration, self.edge.net)
                self.checked["stage0 trainings"] += 1
        return optimizer_step

    def _edge_publish(self, original: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
        def publish(*versions: list[int]) -> torch.nn.Module:
            i, S = self.edge.train_iteration, self.bound
            if self.hold and i + S <= self.settings.num_iterations:  # not before rollout i + S has started
                self._wait(lambda: (i + S, 0, 0) in self.s0_steps, f"the rollout of iteration {i + S} to start")
            with self.cond:
                module = original(*versions)
                for version in versions[0] if versions else [i * self.per_iteration]:
                    self._register("stage0", module, version)
                    self.published.add(version)
                self.cond.notify_all()
            return module
        return publish

    # -- stage1 ------------------------------------------------------------------------------------------------

    def watch_learner(self, learner: Any) -> None:
        self.learner = learner
        self._freeze(self.heads, 0, learner.heads)
        if learner.acting is not learner.heads:
            self._register("stage1", learner.acting, 0)
        self._plant("stage1", learner)
        for name in ("act_groups", "end_rollout", "begin_training", "loss", "optimizer_step", "publish"):
            setattr(learner, name, getattr(self, f"_learner_{name}")(getattr(learner, name)))

    def _stage1_version(self, where: tuple[int, str]) -> int:
        learner = self.learner
        return self._version_of("stage1", learner.acting, learner.heads, learner.iteration, where)

    def _learner_act_groups(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def act_groups(steps: list[tuple[int, int, Any]], order_free: bool = False) -> Any:
            i = self.learner.iteration
            version = self._stage1_version((i, f"(t={steps[0][1]}, group {steps[0][0]})"))
            for g, t, _ in steps:
                self.s1_steps[(i, t, g)] = version
            return original(steps, order_free)
        return act_groups

    def _learner_end_rollout(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def end_rollout(msg: Any, g: int = 0) -> Any:
            i = self.learner.iteration
            self.s1_ends[(i, g)] = self._stage1_version((i, f"rollout_end of group {g}"))
            return original(msg, g)
        return end_rollout

    def _learner_begin_training(self, original: Callable[[int], Any]) -> Callable[[int], Any]:
        def begin_training(iteration: int) -> Any:
            schedule = original(iteration)
            learner, i = self.learner, iteration
            slot = next(k for k, b in enumerate(learner.buffers) if b is learner.train_buffer)
            start = (i - 1) * self.per_iteration
            differs = _weights_differ(learner.heads, self.heads[start])
            if differs:
                self._fail("d", "versions", i, "the start of training",
                           f"stage1's heads are not version {start} as training left them: {differs}")
            self._check_versions(i, learner.versions[slot])
            self._check_outcomes(i, learner.train_buffer)
            self._check_behaviour(i, slot)
            if self.settings.schedule.rescore:
                self._check_rescore(i, slot)
            buf = learner.train_buffer
            rows = {name: getattr(buf, name).clone() for name in
                    ("actions", "logprobs", "values", "rewards", "terminated", "truncated", "final_values")}
            rows["versions"] = learner.versions[slot].clone()
            rows["last_values"] = learner.last_values[slot].clone()
            if learner.inputs is not None:
                rows["inputs"] = learner.inputs[slot].clone()
            self.snapshots["stage1"] = rows
            self.slot = slot
            self.schedules["stage1"][i] = schedule
            self.parts["stage1"][i] = []
            self.steps_left["stage1"] = sum(len(epoch) for epoch in schedule)
            self.epoch_ends["stage1"] = self._epoch_ends(i, schedule)
            self.checked["stage1 rollouts"] += 1
            return schedule
        return begin_training

    def _check_versions(self, i: int, versions: torch.Tensor) -> None:
        """(d): tag, encoder, heads and stored version agree at every step; lags within the bound."""
        T = self.settings.ppo.num_steps
        for g, rows in enumerate(self.groups):
            seen = set()
            for t in [*range(T), "end"]:
                if t == "end":
                    (tag, encoded), acted, stored = self.s0_ends[(i, g)], self.s1_ends[(i, g)], None
                    where = f"(rollout_end, group {g})"
                else:
                    (tag, encoded), acted = self.s0_steps[(i, t, g)], self.s1_steps[(i, t, g)]
                    stored = {int(versions[t, env]) for env in rows}
                    where = f"(t={t}, env={rows[0]})"
                if self.per_iteration > 1:  # --publish epoch: step t acts after floor(t P / T) epochs of i - 1
                    P = self.per_iteration
                    paced = max(0, (i - 2) * P + (T - 1 if t == "end" else t) * P // T)
                    if tag != paced:
                        self._fail("d", "versions", i, where, f"stage0 tagged the step with version {tag}, the "
                                   f"pace says {paced}")
                if tag is not None and tag != encoded:
                    self._fail("d", "versions", i, where, f"stage0 tagged the step with version {tag} and encoded "
                               f"it with version {encoded}")
                if acted != encoded:
                    self._fail("d", "versions", i, where, f"stage0 encoded the step with version {encoded}, "
                               f"stage1's heads of version {acted} acted on it")
                if stored is not None and stored != {acted}:
                    self._fail("d", "versions", i, where, f"stage1 stored version(s) {sorted(stored)} for a step "
                               f"its heads of version {acted} acted on")
                lag = (i - 1) * self.per_iteration - acted
                if not 0 <= lag <= self.bound * self.per_iteration:
                    self._fail("d", "versions", i, where, f"version {acted} lags {lag}, outside "
                               f"[0, {self.bound * self.per_iteration}]")
                if t != "end":
                    self.lags[lag] += len(rows)
                seen.add(acted)
            self.swaps += len(seen) > 1

    def _check_outcomes(self, i: int, buf: Any) -> None:
        """(b): the env was given the stored action at t, and what it returned is stored at t."""
        T, spec = self.settings.ppo.num_steps, self.edge.spec
        wire = self.learner.heads.wire_action
        for t in range(T):
            for g, rows in enumerate(self.groups):
                step = self.env_steps[g][(i - 1) * T + t]
                given = spec.env_action(wire(buf.actions[t, rows]).numpy(), self.settings.env.action_map)
                for j, env in enumerate(rows):
                    where = f"(t={t}, env={env})"
                    if not np.allclose(step.action[j], given[j], rtol=0, atol=1e-6):
                        self._fail("b", "outcomes", i, where, f"the env was given action {step.action[j].tolist()}, "
                                   f"the stored action maps to {given[j].tolist()}")
                    for name, kept in (("reward", buf.rewards), ("terminated", buf.terminated),
                                       ("truncated", buf.truncated)):
                        returned = float(getattr(step, name)[j])
                        if float(kept[t, env]) != returned:
                            around = ", ".join(
                                f"{float(getattr(self.env_steps[g][(i - 1) * T + t + d], name)[j]):.7g} at t{d:+d}"
                                for d in (-1, 1) if 0 <= t + d < T)
                            self._fail("b", "outcomes", i, where, f"stage1 stored {name} {float(kept[t, env]):.7g}, "
                                       f"the env returned {returned:.7g} for the action at t ({around})")

    def _behaviour(self, version: int, obs: torch.Tensor,
                   actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features, log-prob, value) of ``version``'s encoder and heads on ``obs`` and ``actions``."""
        heads = self.heads[version]
        with torch.no_grad():
            features = self.encoders[version](obs)
            mean, value = heads.outputs(features)
            return features, heads.evaluate(mean, value, actions)[1], value

    def _value(self, version: int, obs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.heads[version].get_value(self.encoders[version](obs))

    def _check_behaviour(self, i: int, slot: int) -> None:
        """(c): each sample's stored behaviour is its version's on the stored observation and action."""
        learner, T = self.learner, self.settings.ppo.num_steps
        buf, versions = learner.train_buffer, learner.versions[slot]
        obs = self._rollout_obs(i)
        # Per sample and quantity: (recomputed, stored, within tolerance); features by their largest difference.
        got = {name: torch.zeros(versions.shape) for name in ("features", "logprob", "value")}
        kept = {"features": torch.zeros(versions.shape), "logprob": buf.logprobs, "value": buf.values}
        ok = {name: torch.ones(versions.shape, dtype=torch.bool) for name in got}
        for v in (int(v) for v in versions.unique()):
            at = versions == v
            features, logprob, value = self._behaviour(v, obs[at], buf.actions[at])
            if learner.inputs is not None:
                stored = learner.inputs[slot][at]
                got["features"][at] = (features - stored).abs().amax(1)
                ok["features"][at] = _close(features, stored).all(1)
            got["logprob"][at], ok["logprob"][at] = logprob, _close(logprob, buf.logprobs[at])
            got["value"][at], ok["value"][at] = value, _close(value, buf.values[at])
            neighbour = v + 1 if v + 1 <= (i - 1) * self.per_iteration else v - 1
            if neighbour >= 0:  # would another version's weights have passed? then the check tells nothing
                other = self._behaviour(neighbour, obs[at], buf.actions[at])[1]
                self.neighbour_tried += int(at.sum())
                self.neighbour_differs += int((~_close(other, buf.logprobs[at])).sum())
        for name in got:
            self.max_err[name] = max(self.max_err[name], float((got[name] - kept[name]).abs().max()))
        for name, what in (("features", "stored features"), ("logprob", "behaviour log-prob"), ("value", "value")):
            if bool(ok[name].all()):
                continue
            t, env = (int(x) for x in (~ok[name]).nonzero()[0])
            v = int(versions[t, env])
            if name == "features":
                detail = (f"stage1's stored features differ by up to {float(got[name][t, env]):.3g} from version "
                          f"{v}'s encoder on the observation")
            else:
                detail = (f"stage1 stored {float(kept[name][t, env]):.7g}; version {v}'s encoder and heads give "
                          f"{float(got[name][t, env]):.7g} on the stored observation and action")
            self._fail("c", what, i, f"(t={t}, env={env})", detail)
        # The bootstrap values: the last observation's, and each truncated episode's real last one's.
        stacked = self.settings.env.image_pipeline[1] > 1
        for g, rows in enumerate(self.groups):
            v = self.s1_ends[(i, g)]
            value = self._value(v, self._obs(g, i * T))
            for j, env in enumerate(rows):
                self._bootstrap(i, f"(t={T}, env={env})", "last value", v, value[j], learner.last_values[slot][env])
            for t in range(T):
                step = self.env_steps[g][(i - 1) * T + t]
                for j, env in enumerate(rows):
                    if j not in step.final_obs:
                        if float(buf.final_values[t, env]) != 0.0:
                            self._fail("c", "bootstrap value", i, f"(t={t}, env={env})",
                                       f"stage1 stored final value {float(buf.final_values[t, env]):.7g} where the "
                                       "env did not truncate")
                        continue
                    # The real last observation rides on the next message: that message's version scores it.
                    w = int(versions[t + 1, env]) if t + 1 < T else v
                    final = torch.as_tensor(to_chw(step.final_obs[j][None], stacked))
                    self._bootstrap(i, f"(t={t}, env={env})", "final value", w, self._value(w, final)[0],
                                    buf.final_values[t, env])
                    self.truncations += 1

    def _check_rescore(self, i: int, slot: int) -> None:
        """(f): ``--rescore``'s baseline and proximal policy are version i - 1's on every sample."""
        learner, obs = self.learner, self._rollout_obs(i)
        buf = learner.train_buffer
        flat_obs = obs.reshape((-1,) + tuple(obs.shape[2:]))
        start = (i - 1) * self.per_iteration
        _, logprob, value = self._behaviour(start, flat_obs, buf.b_actions)
        value, lagging = value.reshape(-1), learner.lagging
        wanted = [("baseline value", buf.b_values, value)]
        if learner.proximal is not None:  # samples lag: their proximal policy is the one that starts training
            wanted.append(("proximal log-prob", learner.proximal[lagging], logprob[lagging]))
        # The value targets: GAE on that baseline, weighted where samples lag by min(1, pi_{i-1} / mu).
        shape, ppo = buf.values.shape, self.settings.ppo
        weights = torch.where(lagging, (logprob - buf.b_logprobs).exp().clamp(max=1.0), torch.ones_like(logprob))
        _, returns = compute_gae(buf.rewards, value.reshape(shape), buf.terminated, buf.truncated, buf.final_values,
                                 learner.last_values[slot], ppo.gamma, ppo.gae_lambda,
                                 weights.reshape(shape) if bool(lagging.any()) else None)
        wanted.append(("value target", buf.b_returns, returns.reshape(-1)))
        for what, kept, got in wanted:
            ok = _close(kept, got)
            self.max_err[what] = max(self.max_err.get(what, 0.0), float((kept - got).abs().max()))
            if not bool(ok.all()):
                k = int((~ok).nonzero()[0])
                self._fail("f", what, i, f"(sample {k})", f"stage1 trains with {float(kept[k]):.7g}; version {start}'s "
                           f"encoder and heads give {float(got[k]):.7g} on the stored observation and action")
        self.checked["rescored rollouts"] += 1

    def _bootstrap(self, i: int, where: str, what: str, version: int, got: torch.Tensor, kept: torch.Tensor) -> None:
        self.max_err["bootstrap"] = max(self.max_err["bootstrap"], float((got - kept).abs()))
        if not bool(_close(got, kept)):
            self._fail("c", "bootstrap value", i, where, f"stage1 stored {what} {float(kept):.7g}; version "
                       f"{version}'s encoder and heads give {float(got):.7g}")

    def _learner_loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def loss(idx: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.parts["stage1"][self.learner.train_iteration].append(idx.clone())
            return original(idx, *args, **kwargs)
        return loss

    def _learner_optimizer_step(self, original: Callable[[], None]) -> Callable[[], None]:
        def optimizer_step() -> None:
            original()
            self.steps_left["stage1"] -= 1
            version = self.epoch_ends["stage1"].get(self.steps_left["stage1"])
            if version is not None and self.steps_left["stage1"] > 0:  # an epoch's end within the iteration
                self._freeze(self.heads, version, self.learner.heads)
            if self.steps_left["stage1"] == 0:
                i = self.learner.train_iteration
                self._check_training(i)
                self._freeze(self.heads, i * self.per_iteration, self.learner.heads)
                self.checked["stage1 trainings"] += 1
        return optimizer_step

    def _check_training(self, i: int) -> None:
        """(e): one minibatch order on both stages; the trained slot did not change while it trained.
        Called after stage1's last optimizer step: stage0 forwarded every part before stage1 could take it."""
        learner, N = self.learner, self.settings.env.num_envs
        for name in ("schedule", "parts"):
            kept = self.schedules if name == "schedule" else self.parts
            s0, s1 = kept["stage0"][i], kept["stage1"][i]
            flat0 = [p for part in s0 for p in (part if name == "schedule" else [part])]
            flat1 = [p for part in s1 for p in (part if name == "schedule" else [part])]
            if len(flat0) != len(flat1):
                self._fail("e", "training data", i, "training", f"stage0's {name} has {len(flat0)} minibatches, "
                           f"stage1's {len(flat1)}")
            for k, (a, b) in enumerate(zip(flat0, flat1)):
                if not torch.equal(a, b):
                    self._fail("e", "training data", i, f"minibatch {k} of the {name}", f"stage0 trains on samples "
                               f"{a[:6].tolist()}..., stage1 on {b[:6].tolist()}...")
        if not torch.equal(torch.cat(self.parts["stage0"][i]), torch.cat([mb for e in self.schedules["stage0"][i]
                                                                            for mb in e])):
            self._fail("e", "training data", i, "training", "stage0 did not train on its schedule's samples in order")
        slot, before = self.slot, self.snapshots.pop("stage1")
        buf = learner.train_buffer
        now = {name: getattr(buf, name) for name in before if hasattr(buf, name)}
        now.update(versions=learner.versions[slot], last_values=learner.last_values[slot])
        if learner.inputs is not None:
            now["inputs"] = learner.inputs[slot]
        for name, was in before.items():
            if not torch.equal(now[name], was):
                changed = (now[name] != was).reshape(was.shape[0], -1).any(1).nonzero()[0].item() \
                    if name != "last_values" else 0
                where = "(t=T, all envs)" if name == "last_values" else f"(t={changed}, row of {N} envs)"
                self._fail("e", "training data", i, where, f"stage1's stored {name} changed while it trained")

    def _learner_publish(self, original: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
        def publish(*versions: list[int]) -> torch.nn.Module:
            with self.cond:
                heads = original(*versions)
                for version in versions[0] if versions else [self.learner.train_iteration * self.per_iteration]:
                    self._register("stage1", heads, version)
            return heads
        return publish

    # -- the run's end ----------------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Checks of the whole run; the summary line's contents."""
        n = self.settings.num_iterations
        for what in ("stage0 rollouts", "stage1 rollouts", "stage0 trainings", "stage1 trainings"):
            if self.checked[what] != n:
                raise ProbeError(f"checked {self.checked[what]} {what} of {n} iterations")
        if self.settings.schedule.rescore and self.checked["rescored rollouts"] != n:
            raise ProbeError(f"checked {self.checked['rescored rollouts']} rescored rollouts of {n} iterations")
        if self.neighbour_differs == 0:
            self._fail("c", "behaviour", n, "the whole run", f"no neighbouring version's log-prob differed from the "
                       f"stored one on any of {self.neighbour_tried} samples: the check cannot tell versions apart")
        return {
            "ok": True, "splitrl": str(Path(splitrl.__file__).parent), "mode": self.settings.schedule.mode,
            "max_staleness": self.bound, "hold": self.hold, "versions_per_iteration": self.per_iteration,
            "iterations": n, "samples": sum(self.lags.values()),
            "invariants": ["a observations", "b outcomes", "c behaviour", "d versions", "e training data"]
            + (["f rescore"] if self.settings.schedule.rescore else []),
            "rescored_rollouts": self.checked["rescored rollouts"],
            "lags": {str(k): v for k, v in sorted(self.lags.items())},
            "rollouts_swapping_in_flight": self.swaps, "truncations": self.truncations,
            "neighbour_samples": self.neighbour_tried, "neighbour_mismatches": self.neighbour_differs,
            "max_abs_err": {k: float(f"{v:.3g}") for k, v in self.max_err.items()},
            "minibatch_parts": sum(len(p) for p in self.parts["stage1"].values()),
        }


# -- planted bugs ----------------------------------------------------------------------------------------------


def _plant_obs_late(edge: Any) -> None:
    observe, last = edge.observe, {}

    def late_observe(t: int, g: int = 0) -> Any:
        out = observe(t, g)
        rows = slice(int(edge.groups[g][0]), int(edge.groups[g][-1]) + 1)
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
    first = _frozen(edge.net)

    def stale(idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return first(edge.flat_obs[idx])

    edge.features_now = stale


def _plant_outcome_late(learner: Any) -> None:
    record = learner._record_outcomes
    last = learner.settings.ppo.num_steps - 1
    learner._record_outcomes = lambda outcomes: record([(min(step + 1, last), g, o) for step, g, o in outcomes])


def _plant_adopt_late(learner: Any) -> None:
    act_groups, before = learner.act_groups, [learner.acting]

    def late_act_groups(steps: list[tuple[int, int, Any]], order_free: bool = False) -> Any:
        now = learner.acting
        if now is before[0]:
            return act_groups(steps, order_free)
        learner.acting, before[0] = before[0], now
        try:
            return act_groups(steps, order_free)
        finally:
            learner.acting = now

    learner.act_groups = late_act_groups


def _plant_reshuffle(learner: Any) -> None:
    begin_training = learner.begin_training
    learner.begin_training = lambda iteration: [epoch[::-1] for epoch in begin_training(iteration)]


# -- the command -----------------------------------------------------------------------------------------------

PLANT_STAGES: dict[str, tuple[str, Callable[[Any], None]]] = {
    "obs-late": ("stage0", _plant_obs_late), "version-tag": ("stage0", _plant_version_tag),
    "rescore-stale": ("stage0", _plant_rescore_stale), "outcome-late": ("stage1", _plant_outcome_late),
    "adopt-late": ("stage1", _plant_adopt_late), "reshuffle": ("stage1", _plant_reshuffle),
}
"""Each planted bug's stage and what plants it (`PLANTS` says what it does)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python benchmarks/async_probe.py",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Everything after -- goes to `splitrl train`.")
    parser.add_argument("--hold", action="store_true", help="make the largest lag and in-flight swaps happen")
    parser.add_argument("--plant", choices=sorted(PLANTS), help="corrupt one thing on purpose")
    args = parser.parse_args(own)

    from splitrl.cli.train import train
    from splitrl.runner import build

    probe = Probe(hold=args.hold, plant=args.plant)
    make_edge, make_learner = build.make_edge, build.make_learner

    def watched_learner(settings: Any, spec: Any) -> Any:
        probe.take_settings(settings)
        learner = make_learner(settings, spec)
        probe.watch_learner(learner)
        return learner

    def watched_edge(*a: Any, **kw: Any) -> Any:
        edge = make_edge(*a, **kw)
        probe.watch_edge(edge)
        return edge

    build.make_edge, build.make_learner = watched_edge, watched_learner
    try:  # the builders are put back, so one process (the tests) can run the probe again and again
        with tempfile.TemporaryDirectory(prefix="async-probe-") as tmp:
            if "--run-dir" not in train_args and "--resume" not in train_args:
                train_args += ["--run-dir", str(Path(tmp) / "run")]
            try:
                train.main(args=train_args, prog_name="async_probe", standalone_mode=False)
            except BaseException as exc:  # the run stops on the first broken invariant, however it surfaces
                if probe.failure is not None:
                    print(probe.failure, file=sys.stderr)
                    return 1
                if isinstance(exc, ProbeError):
                    print(f"async probe: {exc}", file=sys.stderr)
                    return 2
                traceback.print_exc()
                return 2
    finally:
        build.make_edge, build.make_learner = make_edge, make_learner
    if probe.failure is not None:
        print(probe.failure, file=sys.stderr)
        return 1
    try:
        summary = probe.finish()
    except InvariantBroken as exc:
        print(exc, file=sys.stderr)
        return 1
    except ProbeError as exc:
        print(f"async probe: {exc}", file=sys.stderr)
        return 2
    if args.plant:
        summary["planted"] = args.plant
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

