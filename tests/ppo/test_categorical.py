"""The categorical policy of discrete action spaces, against torch.distributions.Categorical."""

import pytest
import torch
from torch.testing import assert_close

from splitrl.ppo import Categorical, RolloutBuffer


def _logits(batch=64, actions=5, seed=0):
    return 3 * torch.randn(batch, actions, generator=torch.Generator().manual_seed(seed))


def test_log_prob_and_entropy_match_torch():
    logits = _logits()
    ours, ref = Categorical(logits), torch.distributions.Categorical(logits=logits)
    actions = torch.arange(64) % 5
    lp = ours.log_prob(actions)
    assert lp.shape == (64,) and lp.dtype == torch.float32
    assert_close(lp, ref.log_prob(actions))
    assert_close(ours.entropy(), ref.entropy())
    assert_close(ours.probs, ref.probs)


def test_a_zero_probability_action_keeps_the_entropy_finite():
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    ours = Categorical(logits)
    assert torch.isfinite(ours.entropy()).all()
    assert_close(ours.entropy(), torch.distributions.Categorical(logits=logits).entropy())
    assert ours.log_prob(torch.tensor([1])).item() == float("-inf")


def test_gradients_match_torch():
    logits = _logits(batch=8).requires_grad_()
    twin = logits.detach().clone().requires_grad_()
    actions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    (Categorical(logits).log_prob(actions).sum() + Categorical(logits).entropy().sum()).backward()
    ref = torch.distributions.Categorical(logits=twin)
    (ref.log_prob(actions).sum() + ref.entropy().sum()).backward()
    assert_close(logits.grad, twin.grad)


def test_sampling_follows_the_generator_and_the_probabilities():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]])).expand(20_000, 3)
    first = Categorical(logits).sample(torch.Generator().manual_seed(3))
    again = Categorical(logits).sample(torch.Generator().manual_seed(3))
    assert first.dtype == torch.int64 and first.shape == (20_000,)
    assert torch.equal(first, again)  # what keeps a split run and its twin acting alike
    freq = torch.bincount(first, minlength=3).float() / len(first)
    assert_close(freq, torch.tensor([0.1, 0.2, 0.7]), atol=0.015, rtol=0)
    assert not torch.equal(first, Categorical(logits).sample(torch.Generator().manual_seed(4)))


def test_mode_is_the_most_likely_action():
    assert Categorical(torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])).mode().tolist() == [1, 0]


def test_a_discrete_rollout_buffer_keeps_int64_indices():
    buf = RolloutBuffer(4, 2, 5, discrete=True)
    assert buf.actions.shape == (4, 2) and buf.actions.dtype == torch.int64
    for t in range(4):
        buf.add(t, actions=torch.tensor([t, 4 - t]), logprobs=torch.zeros(2), values=torch.zeros(2))
        buf.add_outcome(t, rewards=torch.ones(2), terminated=torch.zeros(2), truncated=torch.zeros(2))
    buf.finish(torch.zeros(2))
    assert buf.b_actions.shape == (8,) and buf.b_actions.dtype == torch.int64
    assert buf.b_actions.tolist() == [0, 4, 1, 3, 2, 2, 3, 1]  # step-major, as obs.reshape(-1, ...)


@pytest.mark.parametrize("discrete", [False, True])
def test_the_buffer_keeps_the_action_layout_the_policy_gives(discrete):
    buf = RolloutBuffer(2, 3, 4, discrete=discrete)
    assert buf.actions.shape == ((2, 3) if discrete else (2, 3, 4))
    assert buf.actions.dtype == (torch.int64 if discrete else torch.float32)
