"""Stage1's rollouts: one group's step, written as a slice, stores what the same step written with another group's
by their rows' indices stores."""

from __future__ import annotations

import torch

from splitrl.envs import VECTOR, EnvSpec
from splitrl.settings import EnvSettings, PPOSettings, TrainSettings
from splitrl.stages.rollouts import Groups, Rollouts, sample_indices

SPEC = EnvSpec(obs_shape=(4,), action_dim=2, action_low=(-1.0, -1.0), action_high=(1.0, 1.0), observation=VECTOR)


def _rollouts() -> Rollouts:
    rollouts = Rollouts(TrainSettings(env=EnvSettings(num_envs=4), ppo=PPOSettings(num_steps=3)), SPEC, 1,
                        ((4,), torch.float32), torch.device("cpu"))
    rollouts.groups = Groups(4, 2)
    return rollouts


def _step(g: int) -> tuple:
    gen = torch.Generator().manual_seed(g)
    outcome = (torch.randn(2, generator=gen), torch.tensor([g == 0, False]), torch.tensor([False, g == 1]),
               torch.randn(2, generator=gen))
    acted = {"actions": torch.randn(2, 2, generator=gen), "logprobs": torch.randn(2, generator=gen),
             "values": torch.randn(2, generator=gen)}
    return outcome, torch.randn(2, 4, generator=gen), acted


def test_one_groups_step_as_a_slice_stores_what_the_groups_together_store_by_index():
    alone, together = _rollouts(), _rollouts()
    steps = [_step(g) for g in (0, 1)]
    for g, (outcome, x, acted) in enumerate(steps):  # each group's step alone: a slice
        alone.record_outcomes(1, [(1, g, outcome)])
        alone.store(1, [(2, g)], x, 7, **acted)
    # both groups' in one call, as a fleet's edges acted for together: the rows by their indices
    together.record_outcomes(1, [(1, g, outcome) for g, (outcome, _, _) in enumerate(steps)])
    together.store(1, [(2, 0), (2, 1)], torch.cat([x for _, x, _ in steps]), 7,
                   **{k: torch.cat([acted[k] for _, _, acted in steps]) for k in steps[0][2]})
    a, b = alone.buffers[1], together.buffers[1]
    for name in ("actions", "logprobs", "values", "rewards", "terminated", "truncated", "final_values"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(alone.inputs[1], together.inputs[1]) and torch.equal(alone.versions[1], together.versions[1])
    # what was written, where: group 1's second env truncated (its final value kept), group 0's first terminated
    assert a.truncated[1].tolist() == [0.0, 0.0, 0.0, 1.0] and a.terminated[1].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert a.final_values[1, 3] == steps[1][0][3][1] and a.final_values[1, :3].tolist() == [0.0, 0.0, 0.0]
    assert alone.versions[1][2].tolist() == [7, 7, 7, 7] and alone.versions[1][1].sum() == 0


def test_an_outcome_with_no_final_values_stores_zeros_as_with_them_and_mixes_with_one_that_has_them():
    """`read_outcome` gives no final values where no env needs one: the step's rows read 0, as with zeros given
    (a slice, and by rows beside a group that has them)."""
    given, none, mixed, mixed_zeros = _rollouts(), _rollouts(), _rollouts(), _rollouts()
    for r in (given, none, mixed, mixed_zeros):
        r.buffers[1].final_values.fill_(5.0)  # a slot's last rollout left values: each step writes its own
    flags = torch.tensor([True, False]), torch.tensor([True, False])  # terminated and truncated: no bootstrap
    given.record_outcomes(1, [(0, 0, (torch.ones(2), *flags, torch.zeros(2)))])
    none.record_outcomes(1, [(0, 0, (torch.ones(2), *flags, None))])
    (outcome, _, _) = _step(1)
    mixed.record_outcomes(1, [(0, 0, (torch.ones(2), *flags, None)), (0, 1, outcome)])
    mixed_zeros.record_outcomes(1, [(0, 0, (torch.ones(2), *flags, torch.zeros(2))), (0, 1, outcome)])
    for name in ("rewards", "terminated", "truncated", "final_values"):
        assert torch.equal(getattr(given.buffers[1], name), getattr(none.buffers[1], name)), name
        assert torch.equal(getattr(mixed.buffers[1], name), getattr(mixed_zeros.buffers[1], name)), name
    assert none.buffers[1].final_values[0, :2].tolist() == [0.0, 0.0]
    assert none.buffers[1].final_values[1].tolist() == [5.0] * 4


def test_a_step_acted_on_by_the_rollouts_first_version_writes_no_version_and_another_writes_its_own():
    rollouts = _rollouts()
    rollouts.versions[1].fill_(9)  # the slot's last rollout's
    rollouts.begin(1, 3)
    _, x, acted = _step(0)
    rollouts.store(1, [(0, 0)], x, 3, **acted)
    rollouts.store(1, [(1, 1)], x, 4, **acted)  # the asynchronous schedule's rollout, after a new version
    rollouts.store(2, [(2, 0), (2, 1)], torch.cat([x, x]), 5, **{k: torch.cat([v, v]) for k, v in acted.items()})
    assert rollouts.versions[1].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [5, 5, 5, 5]]


def test_a_steps_sample_indices_are_its_row_of_the_rollout_batch_and_an_edges_its_share():
    rollouts = _rollouts()
    assert rollouts.sample_index[2, rollouts.groups.slices[1]].tolist() == [2 * 4 + 2, 2 * 4 + 3]
    assert torch.equal(rollouts.sample_index.flatten(), torch.arange(3 * 4))
    edge = sample_indices(3, 8, slice(4, 8))  # a fleet's second edge of four envs
    assert edge[0].tolist() == [4, 5, 6, 7] and edge[2, 1:3].tolist() == [2 * 8 + 5, 2 * 8 + 6]
