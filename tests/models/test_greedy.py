"""The greedy action of a trained policy (`splitrl.models.greedy`): each rule is what it says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitrl.envs import to_env_action
from splitrl.models.greedy import GREEDY_RULES, GreedyAction

CAR = ((-1.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # CarRacing: steer, gas, brake


def _means(rows: int = 64, dim: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("action_map", ["clip", "affine"])
def test_mean_is_tanh_of_the_mean_mapped_as_the_envs_map_it(action_map):
    mean = _means()
    got = GreedyAction(*CAR, action_map, "mean", torch.full((3,), -0.5))(mean)
    want = to_env_action(torch.tanh(mean).numpy(), np.array(CAR[0]), np.array(CAR[1]), action_map)
    assert np.allclose(got.numpy(), want, atol=1e-6)


@pytest.mark.parametrize("action_map", ["clip", "affine"])
@pytest.mark.parametrize("log_std", [-2.0, -0.5, 0.3, 1.0])
def test_expected_is_the_mean_env_action_over_the_policys_draws(action_map, log_std):
    mean, std = _means(rows=8), float(np.exp(log_std))
    got = GreedyAction(*CAR, action_map, "expected", torch.full((3,), log_std))(mean).numpy()
    # the integral on a grid 40 times as fine and twice as wide, in float64
    z = np.linspace(-12.0, 12.0, 200_001)
    weight = np.exp(-0.5 * z * z) / np.exp(-0.5 * z * z).sum()
    u = mean.numpy().astype(np.float64)[..., None] + std * z
    env = to_env_action(np.tanh(u).transpose(0, 2, 1).reshape(-1, 3), np.array(CAR[0]), np.array(CAR[1]), action_map)
    integral = (env.reshape(8, len(z), 3).astype(np.float64) * weight[None, :, None]).sum(1)
    assert np.abs(got - integral).max() < 2e-4
    # and what draws of the policy average to
    draws = mean + std * torch.randn(100_000, *mean.shape, generator=torch.Generator().manual_seed(1))
    drawn = to_env_action(torch.tanh(draws).reshape(-1, 3).numpy(), np.array(CAR[0]), np.array(CAR[1]), action_map)
    assert np.abs(got - drawn.reshape(100_000, 8, 3).mean(0)).max() < 0.01


def test_a_brake_whose_mean_is_negative_brakes_in_expectation_but_never_at_the_mean():
    mean = torch.tensor([[0.0, 0.5, -0.3]])
    expected = GreedyAction(*CAR, "clip", "expected", torch.full((3,), -0.5))(mean)[0]
    at_mean = GreedyAction(*CAR, "clip", "mean", torch.full((3,), -0.5))(mean)[0]
    assert at_mean[2] == 0.0 and 0.05 < expected[2] < 0.5


@pytest.mark.parametrize("log_std", [-0.5, -1.0, -0.4])
def test_mode_is_the_most_likely_squashed_action(log_std):
    """On a fine grid of a in (-1, 1), the density of a = tanh(u), u ~ N(m, s^2), peaks where the rule says."""
    mean = torch.tensor([[-1.2, 0.1, 0.9]])
    s = float(np.exp(log_std))
    got = GreedyAction((-1.0,) * 3, (1.0,) * 3, "clip", "mode", torch.full((3,), log_std))(mean)[0].numpy()
    a = np.linspace(-0.99999, 0.99999, 400_001)
    for d in range(3):
        log_density = -((np.arctanh(a) - mean[0, d].item()) ** 2) / (2 * s * s) - np.log1p(-a * a)
        assert abs(got[d] - a[np.argmax(log_density)]) < 1e-4


def test_discrete_policies_take_the_largest_logit_shifted_to_the_spaces_start():
    logits = _means(rows=32, dim=5)
    for rule in GREEDY_RULES:
        got = GreedyAction((2.0,), (6.0,), "clip", rule, discrete=True)(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1) + 2)


def test_unknown_rules_and_maps_are_refused():
    with pytest.raises(ValueError, match="greedy rule 'best'"):
        GreedyAction(*CAR, "clip", "best")
    with pytest.raises(ValueError, match="action map 'wrap'"):
        GreedyAction(*CAR, "wrap")
