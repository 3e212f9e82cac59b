"""Stage1's rollouts: one group's step, written as a slice, stores what the same step written with another group's
by their rows' indices stores."""

from __future__ import annotations

import torch

from splitrl.envs import VECTOR, EnvSpec
from splitrl.settings import EnvSettings, PPOSettings, TrainSettings
from splitrl.stages.rollouts import Groups, Rollouts

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
