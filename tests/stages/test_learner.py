"""The learner's bookkeeping of policy versions: which samples lag, what they are weighted by."""

import pytest
import torch

from splitrl.envs import EnvSpec
from splitrl.ppo import compute_gae
from splitrl.settings import EnvSettings, PPOSettings, TrainSettings
from splitrl.stages import Learner
from splitrl.transport.wire import Message

SPEC = EnvSpec(obs_shape=(4, 96, 96), action_dim=3, action_low=(-1.0, 0.0, 0.0), action_high=(1.0, 1.0, 1.0))
SETTINGS = TrainSettings(env=EnvSettings(num_envs=2), ppo=PPOSettings(num_steps=4, epochs=1, minibatches=2))


def _rollout(learner, iteration, features, adopt_at=None):
    """Four steps of two envs; with ``adopt_at`` the heads of version 1 act from that step on."""
    learner.begin_rollout(iteration)
    outcome = {"reward": torch.ones(2), "terminated": torch.zeros(2, dtype=torch.bool),
               "truncated": torch.zeros(2, dtype=torch.bool)}
    for t in range(4):
        if t == adopt_at:
            learner.adopt(1)
        tensors = {"features": features[t]} if t == 0 else {"features": features[t], **outcome}
        learner.act(t, Message("step", {}, tensors))
    learner.end_rollout(Message("rollout_end", {}, {"features": features[4], **outcome}))


def test_samples_an_older_policy_acted_on_are_weighted_by_the_one_that_trains_and_keep_their_values():
    g = torch.Generator().manual_seed(0)
    learner = Learner(SETTINGS, SPEC, slots=2, acting_copy=True)
    first = torch.rand(5, 2, 4096, generator=g)
    _rollout(learner, 1, first)
    learner.begin_training(1)
    assert learner.rollout_stats["async/staleness_max"] == 0  # version 0 acted, version 0 trains
    with torch.no_grad():  # "training" iteration 1
        for p in learner.heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    learner.publish()

    second = torch.rand(5, 2, 4096, generator=g)
    _rollout(learner, 2, second, adopt_at=2)  # steps 0 and 1 acted by version 0, steps 2 and 3 by version 1
    b = learner.rollouts.buffers[0]
    behaviour_logprobs, behaviour_values = b.logprobs.clone(), b.values.clone()
    learner.begin_training(2)
    assert learner.rollout_stats["async/staleness_mean"] == 0.5
    assert learner.rollout_stats["async/staleness_max"] == 1

    # What the heads that train say about every sample; only the two lagging steps take it.
    with torch.no_grad():
        mean, value = learner.heads.outputs(second[:4].reshape(8, 4096))
        _, logprob, _, _ = learner.heads.evaluate(mean, value, b.actions.reshape(8, 3))
        last_value = learner.heads.get_value(second[4])
    value, logprob = value.reshape(4, 2), logprob.reshape(4, 2)
    # The values stay the acting network's: the training heads on the older encoder's features are no network
    # that ever was (docs/benchmarks/pipeline.md, "Learning").
    assert torch.equal(b.values, behaviour_values)
    assert not torch.allclose(value[:2], behaviour_values[:2])  # (they would differ)
    assert torch.equal(b.logprobs, behaviour_logprobs)  # PPO's ratio stays against the policy that acted
    weights = torch.ones(4, 2)
    weights[:2] = (logprob[:2] - behaviour_logprobs[:2]).exp().clamp(max=1.0)
    assert bool((weights[:2] < 1).any())  # the policy moved: some weights bite
    # Bootstrapped by version 1, the current one.
    torch.testing.assert_close(learner.rollouts.last_values[0], last_value)
    advantages, returns = compute_gae(b.rewards, b.values, b.terminated, b.truncated, b.final_values,
                                      learner.rollouts.last_values[0], 0.99, 0.95, weights)
    torch.testing.assert_close(b.advantages, advantages)
    torch.testing.assert_close(b.returns, returns)

    # Decoupled PPO for the lagging samples: clipped against the policy that trains as it first sees them, so a
    # first look starts at ratio 1; the behaviour log-probability enters only as the weight min(1, pi_prox / mu).
    with torch.no_grad():
        # The lagging samples' targets are 3 above what version 0 said, and the critic moved there since: by
        # more than the clip. (b_returns is a view of returns.)
        b.returns[:2] += 3.0
        learner.heads.critic[-1].bias.add_(3.0)
        loss = learner.loss(torch.arange(8), *learner.heads.outputs(second[:4].reshape(8, 4096)))
    assert abs(learner.stats["losses/approx_kl"][-1]) < 1e-6 and learner.stats["losses/clipfrac"][-1] == 0.0
    torch.testing.assert_close(learner.decoupled.proximal[:4], logprob[:2].reshape(-1))  # t = 0, 1: the lagging ones
    assert learner.decoupled.lagging.tolist() == [True] * 4 + [False] * 4
    assert torch.isfinite(loss)
    # Their value clip is centred on the proximal values too: a first look is not clipped at all, while the others
    # are clipped against the values the acting network gave.
    with torch.no_grad():
        new_values = learner.heads.outputs(second[:4].reshape(8, 4096))[1]
    torch.testing.assert_close(learner.decoupled.proximal_values[:4], new_values[:4])
    centre = torch.cat([new_values[:4], behaviour_values.reshape(-1)[4:8]])
    clipped = centre + (new_values - centre).clamp(-0.2, 0.2)
    targets = b.returns.reshape(-1)[:8]
    expected = 0.5 * torch.max((new_values - targets) ** 2, (clipped - targets) ** 2).mean()
    assert learner.stats["losses/value_loss"][-1] == pytest.approx(float(expected), rel=1e-5)


def _heads_grad(learner, parts):
    """The heads' gradient after the loss of each (idx, minibatch) part, summed as the fleet's loop sums them."""
    learner.heads.zero_grad()
    features = learner.train_features
    for idx, minibatch in parts:
        learner.loss(idx, *learner.heads.outputs(features[idx]), minibatch).backward()
    return [p.grad.clone() for p in learner.heads.parameters() if p.grad is not None]


def test_a_dropped_edges_samples_take_no_part_in_the_heads_gradient():
    """Two edges of one env each: edge 1 dropped, the minibatch is edge 0's share alone (`Roster.members`)."""
    g = torch.Generator().manual_seed(1)
    features = torch.rand(5, 2, 4096, generator=g)

    def trained(poison: bool) -> list[torch.Tensor]:
        learner = Learner(SETTINGS, SPEC)
        _rollout(learner, 1, features)
        learner.begin_training(1)
        b = learner.train_buffer
        learner.train_features = features[:4].reshape(8, 4096)
        if poison:  # whatever edge 1's rows hold must not matter
            for name in ("b_advantages", "b_returns", "b_values", "b_logprobs"):
                getattr(b, name)[1::2] = 1e6
        idx = torch.arange(8)
        owner = idx % 2  # env e is edge e (one env per edge)
        members = idx[owner == 0]
        return _heads_grad(learner, [(members, members)])

    alone = trained(False)
    assert all(torch.isfinite(gr).all() for gr in alone)
    assert all(torch.equal(a, b) for a, b in zip(alone, trained(True)))


def test_a_minibatch_in_shares_gives_the_whole_minibatchs_gradient():
    """The fleet's shares (one per edge, weighted by `Learner.loss`'s ``minibatch``) add up to the minibatch."""
    g = torch.Generator().manual_seed(2)
    features = torch.rand(5, 2, 4096, generator=g)
    learner = Learner(SETTINGS, SPEC)
    _rollout(learner, 1, features)
    learner.begin_training(1)
    learner.train_features = features[:4].reshape(8, 4096)
    idx = torch.arange(8)
    whole = _heads_grad(learner, [(idx, None)])
    shares = _heads_grad(learner, [(idx[idx % 2 == e], idx) for e in (0, 1)])
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(whole, shares))


def test_the_log_std_steps_at_its_own_rate_only_when_given_one():
    """``--lr-log-std``: the policy's spread in an Adam group of its own at that rate (annealed with the rest);
    left at 0, one group at the heads' rate, as the paper's runs and their checkpoints have it."""
    plain = Learner(SETTINGS, SPEC, slots=2)
    assert [g["lr"] for g in plain.optimizer.param_groups] == [SETTINGS.ppo.lr_heads]
    own = TrainSettings(env=SETTINGS.env, ppo=PPOSettings(num_steps=4, epochs=1, minibatches=2, lr_log_std=0.01,
                                                          anneal_lr=True))
    learner = Learner(own, SPEC, slots=2)
    rest, spread = learner.optimizer.param_groups
    assert spread["params"] == [learner.heads.actor_logstd] and spread["lr"] == 0.01
    assert all(p is not learner.heads.actor_logstd for p in rest["params"]) and rest["lr"] == own.ppo.lr_heads
    learner.update.anneal(0.5)
    assert (rest["lr"], spread["lr"]) == (own.ppo.lr_heads * 0.5, 0.005)
    before = learner.heads.actor_logstd.detach().clone()
    learner.heads.actor_logstd.grad = torch.ones(3)
    learner.optimizer.step()  # Adam's first step moves each value by its rate
    assert torch.allclose(before - learner.heads.actor_logstd.detach(), torch.full((3,), 0.005), atol=1e-6)


def test_a_log_std_floor_sets_the_spread_back_after_each_step_and_nothing_else():
    """``--log-std-floor``: after the step, a log-std below the floor is the floor; one above it, and every other
    weight, is what Adam made it. Left at the clamp's -5, the step is Adam's alone."""
    assert Learner(SETTINGS, SPEC, slots=2).update.floored is None
    ppo = PPOSettings(num_steps=4, epochs=1, minibatches=2, lr_log_std=0.3, log_std_floor=-0.6)
    floored = Learner(TrainSettings(env=SETTINGS.env, ppo=ppo), SPEC, slots=2)
    free = Learner(TrainSettings(env=SETTINGS.env, ppo=PPOSettings(num_steps=4, epochs=1, minibatches=2,
                                                                   lr_log_std=0.3)), SPEC, slots=2)
    free.heads.load_state_dict(floored.heads.state_dict())
    for learner in (floored, free):
        for p in learner.heads.parameters():
            p.grad = torch.full_like(p, 1e-3)
        learner.heads.actor_logstd.grad = torch.tensor([1.0, -1.0, 1.0])  # Adam moves each by 0.3: down, up, down
        learner.update.step()
    adam = free.heads.actor_logstd.detach()
    assert torch.allclose(adam, torch.tensor([-0.8, -0.2, -0.8]), atol=1e-4)  # (Adam's eps, 1e-5)
    assert torch.equal(floored.heads.actor_logstd.detach(), torch.tensor([-0.6, float(adam[1]), -0.6]))
    assert all(torch.equal(a, b) for (name, a), b in zip(floored.heads.state_dict().items(),
                                                         free.heads.state_dict().values()) if name != "actor_logstd")


def test_the_heads_act_on_one_thread_and_train_on_every_thread(monkeypatch):
    """`splitrl.devices.acting_threads`: a step's forward of two envs' rows takes one intra-op thread."""
    learner = Learner(SETTINGS, SPEC)
    seen, outputs = [], learner.heads.outputs
    monkeypatch.setattr(learner.heads, "outputs", lambda x: seen.append(torch.get_num_threads()) or outputs(x))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _rollout(learner, 1, torch.rand(5, 2, 4096, generator=torch.Generator().manual_seed(3)))
        assert seen == [1] * 4 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)

