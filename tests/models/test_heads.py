"""The heads: the categorical actor (Discrete action spaces) behind the Gaussian one's interface; groups scored
together get what each gets alone."""

import math

import pytest
import torch
from torch.testing import assert_close

from splitrl.models import ActorCriticHeads, build_agent

OBS = (4, 48, 48)


def _features(net, batch=6, seed=0):
    obs = torch.randint(0, 256, (batch,) + OBS, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return net(obs)


def test_categorical_heads_give_logits_and_no_log_std():
    net, heads = build_agent(OBS, 5, "cnn", seed=1, discrete=True)
    assert heads.discrete and not hasattr(heads, "actor_logstd")
    logits, value = heads.outputs(_features(net))
    assert logits.shape == (6, 5) and value.shape == (6,)
    # CleanRL's ppo_atari: the logits layer starts near zero (orthogonal, std 0.01), so the first policy is
    # close to uniform.
    last = heads.actor_mean[-1].weight
    assert_close(torch.linalg.matrix_norm(last @ last.T, ord=2), torch.tensor(0.01 ** 2), rtol=1e-4, atol=0)
    assert_close(torch.softmax(logits, -1), torch.full((6, 5), 0.2), atol=0.05, rtol=0)


def test_evaluate_matches_torch_categorical_on_the_heads_logits():
    net, heads = build_agent(OBS, 4, "cnn", seed=2, discrete=True)
    x = _features(net)
    actions = torch.tensor([0, 1, 2, 3, 1, 0])
    got_action, logprob, entropy, value = heads.get_action_and_value(x, actions)
    logits, ref_value = heads.outputs(x)
    ref = torch.distributions.Categorical(logits=logits)
    assert got_action is actions
    assert_close(logprob, ref.log_prob(actions))
    assert_close(entropy, ref.entropy())
    assert_close(value, ref_value)
    assert_close(entropy, torch.full((6,), math.log(4)), atol=0.02, rtol=0)  # near uniform at the start


def test_sampled_actions_are_indices_drawn_from_the_generator():
    net, heads = build_agent(OBS, 3, "cnn", seed=3, discrete=True)
    x = _features(net, batch=32)
    a1, lp1, _, _ = heads.get_action_and_value(x, generator=torch.Generator().manual_seed(7))
    a2, lp2, _, _ = heads.get_action_and_value(x, generator=torch.Generator().manual_seed(7))
    assert a1.dtype == torch.int64 and a1.shape == (32,) and bool(((a1 >= 0) & (a1 < 3)).all())
    assert torch.equal(a1, a2) and torch.equal(lp1, lp2)
    wire = heads.wire_action(a1)
    assert wire.dtype == torch.int64 and torch.equal(wire, a1)


def test_the_loss_reaches_every_weight_of_the_categorical_heads():
    net, heads = build_agent(OBS, 3, "cnn", seed=4, discrete=True)
    x = _features(net)
    _, logprob, entropy, value = heads.get_action_and_value(x, torch.tensor([0, 1, 2, 0, 1, 2]))
    (logprob.sum() + entropy.sum() + value.sum()).backward()
    for name, p in heads.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


def test_the_gaussian_heads_are_what_they_were():
    """The discrete switch must not move the continuous path: same weights, same names, same sampling."""
    net, heads = build_agent(OBS, 3, "cnn", seed=5, init_log_std=-0.5)
    _, discrete_heads = build_agent(OBS, 3, "cnn", seed=5, discrete=True)
    assert not heads.discrete
    assert [n for n, _ in heads.named_parameters()] == ["actor_logstd"] + [
        n for n, _ in discrete_heads.named_parameters()]  # a module's own parameters come before its children's
    # Built from the same seed, the layers the two share start equal: the log-std draws no random numbers.
    for (name, p), (_, q) in zip(list(heads.named_parameters())[1:], discrete_heads.named_parameters()):
        assert torch.equal(p, q), name
    x = _features(net)
    u, _, _, _ = heads.get_action_and_value(x, generator=torch.Generator().manual_seed(0))
    assert u.shape == (6, 3) and u.dtype == torch.float32
    assert torch.equal(heads.wire_action(u), torch.tanh(u))


@pytest.mark.parametrize("discrete", [False, True], ids=["tanh-gaussian", "categorical"])
def test_groups_acted_for_together_get_what_each_gets_alone(discrete):
    """`act` with ``parts``: a group's action and log-prob are those of the same group acting alone,
    whichever groups come with it. Wide means reach softplus's far ranges, where torch's SIMD and scalar loops
    give other last bits on some CPUs (the scoring is padded so that every row takes the SIMD path)."""
    heads = ActorCriticHeads(torch.nn.Identity(), feature_dim=8, action_dim=5 if discrete else 3,
                             init_log_std=-0.5, discrete=discrete)
    source = torch.Generator().manual_seed(3)
    for trial in range(40):
        sizes = torch.randint(1, 5, (1 + trial % 13,), generator=source).tolist()
        means = [torch.randn(size, 5 if discrete else 3, generator=source) * 4 for size in sizes]
        seeds = torch.randint(0, 2**31, (len(sizes),), generator=source).tolist()
        with torch.no_grad():
            together = heads.act(torch.cat(means), [(size, torch.Generator().manual_seed(seed))
                                                    for size, seed in zip(sizes, seeds)])
            alone = [heads.act(mean, [(size, torch.Generator().manual_seed(seed))])
                     for mean, size, seed in zip(means, sizes, seeds)]
        for got, want in zip(together, (torch.cat(column) for column in zip(*alone))):
            assert torch.equal(got, want), (sizes, got, want)


def test_parts_must_cover_the_batch():
    heads = ActorCriticHeads(torch.nn.Identity(), feature_dim=8, action_dim=3)
    with pytest.raises(ValueError, match=r"parts of \[1, 1\] rows for a batch of 3"):
        heads.act(torch.zeros(3, 3), [(1, None), (1, None)])
