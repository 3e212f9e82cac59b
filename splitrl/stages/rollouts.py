"""Where the stages keep their rollouts: several at once (`Slots`), each written by env groups that step in turn
(`Groups`); stage1's whole store (`Rollouts`).

Iteration i's rollout lives in slot ``i % slots``: with two, the asynchronous schedule collects the next rollout
in one while the other trains. The envs may be cut into equal groups that step in turn (the pipelined schedule's
``plan``); each group writes its own envs' columns. Stage0 keeps each rollout's observations (`splitrl.stages.edge`);
stage1 what PPO needs of each sample, as the module's `Rollouts` says.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

import torch

from ..devices import to_device
from ..envs import EnvSpec
from ..ppo import RolloutBuffer
from ..settings import TrainSettings

__all__ = ["Groups", "Rollouts", "Slots", "sample_indices"]

T = TypeVar("T")


def sample_indices(num_steps: int, total_envs: int, envs: slice = slice(None)) -> torch.Tensor:
    """Each sample's index in a rollout batch of ``total_envs`` envs a step, ``t * total_envs + env``, by (step, env)
    for the envs ``envs`` (a fleet edge's share): made once, so a step's indices are a view of its row, not tensor
    arithmetic at every step; row 0 holds the envs' own indices."""
    return torch.arange(num_steps * total_envs).view(num_steps, total_envs)[:, envs]


class Slots(Generic[T]):
    """One ``T`` per rollout stored at once (``make()`` each), looked up by iteration."""

    def __init__(self, slots: int, make: Callable[[], T]) -> None:
        self.items = [make() for _ in range(slots)]

    def __getitem__(self, iteration: int) -> T:
        return self.items[iteration % len(self.items)]

    def __len__(self) -> int:
        return len(self.items)


class Groups:
    """``num_envs`` envs cut into ``groups`` equal groups that step in turn."""

    def __init__(self, num_envs: int, groups: int = 1) -> None:
        if groups < 1 or num_envs % groups:
            raise ValueError(f"{num_envs} envs do not split into {groups} equal groups")
        self.num_envs, self.size = num_envs, num_envs // groups
        self.slices = [slice(g * self.size, (g + 1) * self.size) for g in range(groups)]
        """Each group's envs in the rollout batch, as a slice."""
        self.rows = [torch.arange(g * self.size, (g + 1) * self.size) for g in range(groups)]
        """Each group's env indices in the rollout batch, as a tensor."""

    def __len__(self) -> int:
        return len(self.rows)

    def steps_before(self, t: int, g: int) -> int:
        """The iteration's env steps taken when group ``g``'s step ``t`` is encoded.

        The groups step in order (`splitrl.schedule.pipelined`): before step t + 1 of group g, every
        group has taken t steps and groups 0 .. g one more."""
        return 0 if t == 0 else (t - 1) * self.num_envs + (g + 1) * self.size

    def rows_of(self, parts: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(step, env) index tensors of the rows of ``parts`` ((step, group) each), in that order (one group's step
        alone is a slice of the rollout: `Rollouts.store` writes it as one)."""
        return (torch.tensor([t for t, _ in parts]).repeat_interleave(self.size),
                torch.cat([self.rows[g] for _, g in parts]))


class Rollouts:
    """Stage1's rollouts: for each sample, what PPO needs (`RolloutBuffer`), the policy version that acted on it
    and, if ``inputs`` ((shape, dtype) of one sample's) is given, what stage0 sent for it; for each env, the value
    its rollout bootstraps from; the envs' `groups`."""

    def __init__(self, settings: TrainSettings, spec: EnvSpec, slots: int,
                 inputs: tuple[tuple[int, ...], torch.dtype] | None, device: torch.device) -> None:
        n, t = settings.env.num_envs, settings.ppo.num_steps
        self.steps_per_iteration = settings.steps_per_iteration
        self.device = device
        self.buffers = Slots(slots, lambda: RolloutBuffer(t, n, spec.action_dim, spec.discrete, device))
        self.inputs = (Slots(slots, lambda: torch.zeros((t, n) + inputs[0], dtype=inputs[1], device=device))
                       if inputs else None)
        self.versions = Slots(slots, lambda: torch.zeros((t, n), dtype=torch.int64, device=device))
        """The policy version that acted on each sample: training iterations done before it, or epochs with
        --publish epoch (`TrainSettings.versions_per_iteration`)."""
        self.last_values = Slots(slots, lambda: torch.zeros(n, device=device))
        self.groups = Groups(n)
        self.sample_index = sample_indices(t, n)
        """Each sample's index in the rollout batch (`sample_indices`)."""
        self._begun: list[int | None] = [None] * slots
        """The version `begin` filled each slot's ``versions`` with: a step acted on by it writes none."""

    def begin(self, iteration: int, version: int) -> None:
        """``iteration``'s rollout starts, acted on by ``version`` until a step says otherwise: every sample's
        version is that (rows no step fills, a fleet's dropped edge's, are never trained on: not lagging)."""
        self.versions[iteration].fill_(version)
        self._begun[iteration % len(self.versions)] = version

    def global_step(self, iteration: int, t: int = 0, g: int = 0) -> int:
        """stage0's env-step count when it encoded group ``g``'s step ``t`` of ``iteration`` (`Groups.steps_before`)."""
        return (iteration - 1) * self.steps_per_iteration + self.groups.steps_before(t, g)

    def flat_inputs(self, iteration: int) -> torch.Tensor:
        """``iteration``'s stored inputs, one row per sample (t * num_envs + env)."""
        assert self.inputs is not None
        inputs = self.inputs[iteration]
        return inputs.reshape((-1,) + inputs.shape[2:])

    def store(self, iteration: int, parts: list[tuple[int, int]], x: torch.Tensor, version: int, *,
              actions: torch.Tensor, logprobs: torch.Tensor, values: torch.Tensor) -> None:
        """What the policy ``version`` did on inputs ``x`` at the steps of ``parts`` ((step, group) each)."""
        begun = version == self._begun[iteration % len(self.versions)]  # (its rows hold the version already)
        if len(parts) == 1:  # one group's step: its rows are a slice, written as one (no index tensors)
            at, envs = parts[0][0], self.groups.slices[parts[0][1]]
            self.buffers[iteration].add(at, actions=actions, logprobs=logprobs, values=values, envs=envs)
            if not begun:
                self.versions[iteration][at, envs].fill_(version)  # (a view, filled in place: no tensor of it)
        else:
            at, envs = self.groups.rows_of(parts)
            self.buffers[iteration].add_rows(at, envs, actions=actions, logprobs=logprobs, values=values)
            if not begun:
                self.versions[iteration][at, envs] = version
        if self.inputs is not None:
            self.inputs[iteration][at, envs] = x

    def record_outcomes(self, iteration: int, outcomes: list[tuple[int, int, tuple[torch.Tensor, ...]]]) -> None:
        """Outcomes ((step, group, (reward, terminated, truncated, final values)) each, as
        `splitrl.stages.outcomes.read_outcome` reads them: final values None where no env needs one) into the
        rollout's buffer, all at once."""
        if not outcomes:
            return
        if len(outcomes) == 1:  # one group's: its rows are a slice, written as one (no index tensors, no copies)
            step, g, (reward, terminated, truncated, final_values) = outcomes[0]
            reward, terminated, truncated = (to_device(part, self.device) for part in (reward, terminated, truncated))
            self.buffers[iteration].add_outcome(
                step, rewards=reward, terminated=terminated, truncated=truncated, envs=self.groups.slices[g],
                final_values=0.0 if final_values is None else to_device(final_values, self.device))
            return
        steps, envs = self.groups.rows_of([(step, g) for step, g, _ in outcomes])
        finals = [o[3] for _, _, o in outcomes]
        if all(f is None for f in finals):
            final_values: torch.Tensor | float = 0.0
        else:  # (zeros for the groups with none: the mask reads them nowhere)
            final_values = to_device(torch.cat([torch.zeros(len(o[0]), device=self.device) if f is None else f
                                                for (_, _, o), f in zip(outcomes, finals)]), self.device)
        reward, terminated, truncated = (to_device(torch.cat(parts), self.device)
                                         for parts in list(zip(*(o for _, _, o in outcomes)))[:3])
        self.buffers[iteration].add_outcome_rows(steps, envs, rewards=reward, terminated=terminated,
                                                 truncated=truncated, final_values=final_values)
