"""What stage1 takes from stage0, held against limits on its values (`splitrl.stages.limits`), and the robust sum
of a fleet's encoder gradients (`splitrl.stages.robust`): finite values of any size neither stall nor steer."""

import dataclasses

import pytest
import torch

from splitrl.envs import inspect_env
from splitrl.settings import EnvSettings, PPOSettings, ScheduleSettings, TrainSettings
from splitrl.stages import Learner
from splitrl.stages.exchange import FeaturesLearner
from splitrl.stages.limits import EdgeLimits
from splitrl.stages.robust import combine
from splitrl.transport import Message, ProtocolError

SETTINGS = TrainSettings(env=EnvSettings(env_id="CartPole-v1", num_envs=2), model="mlp", hidden=16,
                         ppo=PPOSettings(num_steps=2, epochs=1, minibatches=1))


def _learner(**schedule):
    settings = dataclasses.replace(SETTINGS, schedule=ScheduleSettings(**schedule))
    learner = Learner(settings, inspect_env(settings.env))
    learner.begin_rollout(1)
    return learner


def _step(learner, t, features=None, reward=1.0):
    n = learner.settings.env.num_envs
    tensors = {"features": features if features is not None else torch.zeros(n, learner.feature_dim)}
    if t:
        tensors.update(reward=torch.full((n,), reward), terminated=torch.zeros(n, dtype=torch.bool),
                       truncated=torch.zeros(n, dtype=torch.bool))
    return Message("step", {"t": t}, tensors)


def test_values_beyond_a_limit_are_a_protocol_error_naming_the_tensor_and_the_option():
    bounded = EdgeLimits.bounded
    x = torch.tensor([0.5, -3.0, 2.0])
    assert bounded("step", "features", x, 3.0, "--edge-feature-limit") is x
    with pytest.raises(ProtocolError, match=r"^step: tensor 'features': a value of -3, beyond --edge-feature-limit "
                                            r"2.5$"):
        bounded("step", "features", x, 2.5, "--edge-feature-limit")
    with pytest.raises(ProtocolError, match="a value of nan"):
        bounded("step", "features", torch.tensor([1.0, float("nan")]), 1e6, "--edge-feature-limit")
    assert bounded("step", "x", torch.tensor([1e30]), float("inf"), "--edge-feature-limit") is not None  # inf: none
    assert bounded("step", "x", torch.tensor([200], dtype=torch.uint8), 1.0, "--edge-feature-limit") is not None


def test_a_step_with_huge_rewards_or_features_is_refused_before_anything_is_stored():
    learner = _learner()
    stored = learner.buffer.rewards.clone(), learner.buffer.actions.clone()
    learner.act_read([learner.read_step(0, 0, _step(learner, 0))])
    with pytest.raises(ProtocolError, match=r"^step: tensor 'reward': a value of 1e\+30, beyond --edge-reward-limit "
                                            r"1e\+06$"):
        learner.read_step(0, 1, _step(learner, 1, reward=1e30))
    huge = torch.full((2, learner.feature_dim), -2e6)
    with pytest.raises(ProtocolError, match=r"^step: tensor 'features': a value of -2e\+06, beyond "
                                            r"--edge-feature-limit 1e\+06$"):
        learner.read_step(0, 1, _step(learner, 1, features=huge))
    assert torch.equal(learner.buffer.rewards[1], stored[0][1]) and torch.equal(learner.buffer.actions[1], stored[1][1])
    learner.act_read([learner.read_step(0, 1, _step(learner, 1, reward=1e6))])  # at the limit: taken
    assert float(learner.buffer.rewards[0, 0]) == 1e6
    roomy = _learner(edge_reward_limit=1e31, edge_feature_limit=float("inf"))  # the limits are settings
    roomy.act_read([roomy.read_step(0, 0, _step(roomy, 0, features=huge))])
    roomy.read_step(0, 1, _step(roomy, 1, reward=1e30))


def test_training_features_beyond_the_limit_and_a_loss_that_is_not_finite_are_refused():
    learner = _learner()
    exchange = FeaturesLearner(learner)
    for t in range(2):
        learner.act_read([learner.read_step(0, t, _step(learner, t))])
    learner.end_rollout(Message("rollout_end", {}, {**_step(learner, 1).tensors}))
    idx = learner.begin_training(1)[0][0]
    fwd = Message("train_fwd", {}, {"features": torch.full((len(idx), learner.feature_dim), 3e6)})
    with pytest.raises(ProtocolError, match="train_fwd: tensor 'features': a value of 3e\\+06, beyond --edge-feature"):
        exchange.features(fwd, idx)
    seen = torch.full((len(idx), learner.feature_dim), float("nan"))  # (the wire and the check refuse this first)
    with pytest.raises(ProtocolError, match="train_fwd: tensor 'features': the PPO loss of these 4 samples is nan"):
        exchange.learn(fwd, idx, seen=seen)
    with pytest.raises(ProtocolError, match="the PPO loss of these 4 samples is nan"):  # a fleet edge's share
        exchange.learn(fwd, idx, idx, seen=seen)
    assert all(p.grad is None for p in learner.params)  # refused before any gradient
    assert not learner.update._parts and not learner.stats.get("losses/value_loss")  # and before any statistic


def test_a_heads_gradient_that_is_not_finite_is_an_error_not_a_silent_step():
    learner = _learner()
    weight = learner.params[0]
    weight.grad = torch.full_like(weight, float("inf"))
    before = weight.detach().clone()
    with pytest.raises(FloatingPointError, match="the heads' gradient has an L2 norm of inf"):
        learner.optimizer_step()
    assert torch.equal(weight.detach(), before)


def test_an_edges_encoder_gradient_is_held_against_the_limit_and_clipped_only_when_asked():
    grads = {"encoder.0.weight": torch.full((4, 3), 2.0), "encoder.0.bias": torch.full((4,), 1.0)}
    norm = (12 * 4 + 4) ** 0.5
    plain = EdgeLimits(ScheduleSettings(edges=2))
    assert plain.gradient("encoder_grad", grads) is grads  # no clip by default: the honest maths unchanged
    clipped = EdgeLimits(ScheduleSettings(edges=2, encoder_sync="grad:clip=1.5")).gradient("encoder_grad", grads)
    total = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in clipped.values()]))
    assert abs(float(total) - 1.5) < 1e-5 and float(clipped["encoder.0.weight"][0, 0]) == pytest.approx(2 * 1.5 / norm)
    huge = {**grads, "encoder.0.weight": torch.full((4, 3), 3e38)}
    with pytest.raises(ProtocolError, match=r"^encoder_grad: tensor 'encoder.0.weight': an L2 norm of 1.04e\+39 "
                                            r"\(of all 2: 1.04e\+39\), beyond --edge-grad-limit 1e\+06$"):
        plain.gradient("encoder_grad", huge)
    roomy = EdgeLimits(ScheduleSettings(edges=2, edge_grad_limit=float("inf"), encoder_sync="grad:clip=1"))
    assert abs(float(roomy.gradient("encoder_grad", huge)["encoder.0.weight"][0, 0]) - 12 ** -0.5) < 1e-6


def test_the_plain_sum_is_the_edges_sum_in_order_and_a_robust_one_keeps_one_edge_from_moving_it_far():
    g = torch.Generator().manual_seed(0)
    like = {"w": torch.zeros(5, 3), "b": torch.zeros(5)}
    honest = [{name: torch.randn(t.shape, generator=g) for name, t in like.items()} for _ in range(4)]
    summed = combine(honest, like)
    for name in like:
        assert torch.equal(summed[name], honest[0][name] + honest[1][name] + honest[2][name] + honest[3][name])
        assert summed[name] is not honest[0][name]
    two = honest[:2]
    for how in ("trimmed", "median"):  # two edges: nothing to trim, the median is the mean: the sum, exactly
        assert all(torch.equal(combine(two, like, how)[n], combine(two, like)[n]) for n in like)
        tiny = [{"w": torch.tensor([1e-45])}, {"w": torch.tensor([0.0])}]  # float32's least subnormal: its half is 0
        assert float(combine(tiny, {"w": torch.zeros(1)}, how)["w"]) > 0
    hostile = {name: torch.full_like(t, 1e6) for name, t in like.items()}
    for how in ("trimmed", "median"):
        robust = combine(honest[:3] + [hostile], like, how)
        for name in like:
            reach = torch.stack([h[name] for h in honest[:3]]).abs().amax(dim=0)
            assert bool((robust[name].abs() <= 4 * reach + 1e-6).all()), (how, name)
        assert float(combine(honest[:3] + [hostile], like)["w"].abs().max()) > 1e5  # the plain sum: moved far
    median = combine([{"w": torch.tensor([1.0])}, {"w": torch.tensor([5.0])}, {"w": torch.tensor([2.0])}],
                     {"w": torch.zeros(1)}, "median")
    assert float(median["w"]) == 6.0  # the median (2) times the 3 edges
    trimmed = combine([{"w": torch.tensor([v])} for v in (1.0, 9.0, 2.0, 4.0)], {"w": torch.zeros(1)}, "trimmed")
    assert float(trimmed["w"]) == 12.0  # (2 + 4) / 2 times the 4 edges
    with pytest.raises(ValueError, match="one of off, trimmed, median"):
        combine(two, like, "mean")


def test_a_check_reads_the_same_bounds_from_numpy_as_from_torch():
    """On the CPU the bounds are numpy's reductions; a tensor numpy cannot hold as it is (bfloat16), or one with
    a graph, takes torch's: each finds the same value beyond the limit."""
    bounded = EdgeLimits.bounded
    values = [0.25, -3.0, 2.0]
    for x in (torch.tensor(values), torch.tensor(values, dtype=torch.float64), torch.tensor(values).half(),
              torch.tensor(values, dtype=torch.bfloat16), torch.tensor(values, requires_grad=True)):
        assert bounded("step", "features", x, 3.0, "--edge-feature-limit") is x
        with pytest.raises(ProtocolError, match=r"a value of -3, beyond --edge-feature-limit 2.5$"):
            bounded("step", "features", x, 2.5, "--edge-feature-limit")
        with pytest.raises(ProtocolError, match=r"a value of 2, beyond --edge-feature-limit 1.5$"):
            bounded("step", "features", x[[0, 2]], 1.5, "--edge-feature-limit")


def test_an_env_cut_short_with_no_final_observation_is_a_protocol_error_and_a_terminated_one_is_not():
    learner = _learner()
    learner.act_read([learner.read_step(0, 0, _step(learner, 0))])
    ended = _step(learner, 1)
    ended.tensors.update(terminated=torch.tensor([True, False]), truncated=torch.tensor([True, False]))
    learner.read_step(0, 1, ended)  # terminated as well: nothing to bootstrap from
    cut = _step(learner, 1)
    cut.tensors["truncated"] = torch.tensor([False, True])
    with pytest.raises(ProtocolError, match=r"^step: envs \[1\] truncated and not terminated, but no final_index"):
        learner.read_step(0, 1, cut)


def test_a_large_tensor_is_checked_as_a_small_one_is():
    """(numpy reads the small one, torch the large)"""
    x = torch.zeros(1 << 17)
    x[12345] = -7.0
    for part in (x, x[: 1 << 16]):
        with pytest.raises(ProtocolError, match=r"a value of -7, beyond --edge-feature-limit 5$"):
            EdgeLimits.bounded("train_fwd", "features", part, 5.0, "--edge-feature-limit")
        assert EdgeLimits.bounded("train_fwd", "features", part, 7.0, "--edge-feature-limit") is part
