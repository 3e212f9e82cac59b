"""The replica exchange: the heads' outputs stand in for the features, exactly when the replica is current."""

import copy

import pytest
import torch

from splitrl.codecs import CodecError, Context
from splitrl.envs import EnvSpec
from splitrl.models import build_agent
from splitrl.ppo import ppo_loss
from splitrl.runs import load_checkpoint
from splitrl.settings import CodecSettings, EnvSettings, Exchange, PPOSettings, TrainSettings
from splitrl.stages import Edge, Learner, ReplicaEdge, ReplicaLearner
from splitrl.stages.replica_plan import FIRST_LAYERS, due, replicated
from splitrl.stages.weights import WeightSync
from splitrl.transport.wire import Message

OBS = (4, 96, 96)


def _batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randint(0, 256, (n,) + OBS, dtype=torch.uint8, generator=g)
    return obs, torch.randn(n, 3, generator=g), [torch.randn(n, generator=g) for _ in range(4)]


def _loss(heads, x, actions, extra, offset=None):
    """The PPO loss with the heads' outputs on ``x``, shifted by ``offset`` as `ReplicaLearner` does."""
    old_logprob, adv, old_values, returns = extra
    mean, value = heads.outputs(x)
    if offset is not None:
        mean, value = mean + offset[:, :-1], value + offset[:, -1]
    _, logprob, entropy, value = heads.evaluate(mean, value, actions)
    return ppo_loss(logprob, old_logprob, adv, value, old_values, returns, entropy)[0]


def _outputs(heads, x):
    mean, value = heads.outputs(x)
    return torch.cat([mean, value[:, None]], dim=1)


def test_with_a_current_replica_the_encoder_gets_the_exact_gradient():
    """Rollout features are stale (the encoder moved since); the replica equals the heads."""
    net_then, heads = build_agent(OBS, 3, "cnn", seed=3)
    net_now = copy.deepcopy(net_then)
    with torch.no_grad():
        for p in net_now.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the encoder after some updates
    obs, actions, extra = _batch(8)
    view = net_then(obs).detach()  # what the rollout sent

    # Exact: stage1 sees the current features.
    exact_net, exact_heads = copy.deepcopy(net_now), copy.deepcopy(heads)
    exact = _loss(exact_heads, exact_net(obs), actions, extra)
    exact.backward()

    # Replica: stage0 sends o(f) - o(view); stage1 adds it to its heads' outputs on the view.
    rep_net, replica = copy.deepcopy(net_now), copy.deepcopy(heads).requires_grad_(False)
    outputs = _outputs(replica, rep_net(obs))
    offset = (outputs.detach() - _outputs(replica, view)).requires_grad_()
    loss = _loss(heads, view, actions, extra, offset)
    loss.backward()
    torch.autograd.backward(outputs, offset.grad)

    torch.testing.assert_close(loss, exact, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(offset.grad) > 0
    for (name, p), q in zip(rep_net.named_parameters(), exact_net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_the_offset_is_the_gradient_of_the_outputs():
    _, heads = build_agent(OBS, 3, "cnn", seed=4)
    x = torch.rand(5, heads.critic[0].in_features)

    def evaluate(offset, action):
        mean, value = heads.outputs(x)
        return heads.evaluate(mean + offset[:, :-1], value + offset[:, -1], action)

    offset = torch.zeros(5, 4, requires_grad=True)
    _, logprob, _, value = evaluate(offset, torch.randn(5, 3))
    (logprob.sum() + 2 * value.sum()).backward()
    assert torch.equal(offset.grad[:, 3], torch.full((5,), 2.0))
    _, plain_logprob, _, plain_value = heads.get_action_and_value(x, torch.zeros(5, 3))
    _, shifted_logprob, _, shifted_value = evaluate(torch.tensor([[0.0, 0.0, 0.0, 1.5]] * 5), torch.zeros(5, 3))
    assert torch.equal(shifted_logprob, plain_logprob) and torch.equal(shifted_value, plain_value + 1.5)
    # The first columns shift the actor's mean: as if its last bias had moved.
    shift = torch.tensor([0.3, -0.2, 0.1])
    _, by_offset, _, _ = evaluate(torch.cat([shift, torch.zeros(1)]).expand(5, 4), torch.zeros(5, 3))
    with torch.no_grad():
        heads.actor_mean[2].bias.add_(shift)
    _, by_bias, _, _ = heads.get_action_and_value(x, torch.zeros(5, 3))
    torch.testing.assert_close(by_offset, by_bias)


@pytest.mark.parametrize("mode", ["int8", "bf16", "fp32"])
def test_heads_sync_keeps_both_views_identical_and_its_error_does_not_pile_up(mode):
    _, heads = build_agent(OBS, 3, "cnn", seed=5)
    sender, receiver = WeightSync(replicated(heads), mode), WeightSync(replicated(heads), mode)
    g = torch.Generator().manual_seed(0)
    worst = []
    for _ in range(5):
        with torch.no_grad():
            for _, p in replicated(heads):
                p.add_(1e-3 * torch.randn(p.shape, generator=g))
        parts = sender.encode(replicated(heads))
        view = receiver.decode(parts)
        for name, p in replicated(heads):
            assert torch.equal(view[name], sender.view[name]), name
        worst.append(max(float((view[n] - p.detach()).abs().max()) for n, p in replicated(heads)))
    if mode == "fp32":
        assert max(worst) < 1e-6
    else:
        # Each update's error is corrected by the next: it stays at one update's quantisation
        # error (half a step of a row whose largest change is ~5e-3), instead of growing.
        assert max(worst) < 3e-5 and worst[-1] < 2 * worst[0]
    nbytes = sum(t.numel() * t.element_size() for t in parts.values())
    weights = sum(p.numel() for _, p in replicated(heads))
    assert nbytes < weights * {"int8": 1.01, "bf16": 2.01, "fp32": 4.01}[mode]


def test_heads_sync_refuses_a_bad_update_and_keeps_its_view():
    _, heads = build_agent(OBS, 3, "cnn", seed=6)
    sender, receiver = WeightSync(replicated(heads)), WeightSync(replicated(heads))
    parts = sender.encode(replicated(heads))
    before = {k: v.clone() for k, v in receiver.view.items()}
    name = next(iter(receiver.view))
    bad = [
        {k: v for k, v in parts.items() if k != f"{name}.q"},
        {**parts, f"{name}.s": torch.full_like(parts[f"{name}.s"], float("nan"))},
        {**parts, f"{name}.q": parts[f"{name}.q"].float()},
        {**parts, "stray": torch.zeros(1)},
        {**parts, f"{name}.s": torch.full_like(parts[f"{name}.s"], 3e38),
         f"{name}.q": torch.full_like(parts[f"{name}.q"], 100)},  # finite, but overflows the weights
    ]
    for update in bad:
        with pytest.raises(CodecError):
            receiver.decode(update)
        assert all(torch.equal(receiver.view[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="mode"):
        WeightSync(replicated(heads), "int4")


def test_midway_updates_follow_the_schedule_both_stages_compute():
    _, heads = build_agent(OBS, 3, "cnn", seed=7)
    names = [n for n, _ in replicated(heads)]
    assert set(FIRST_LAYERS) <= set(names)  # a renamed layer must not silently join the small updates
    rest = [n for n in names if n not in FIRST_LAYERS]
    exchange = Exchange.parse("replica:last_every=2,all_every=6")
    plan = {(e, m): due(exchange, e, m, 3, 4, names) for e in range(3) for m in range(4)}
    # minibatches done: 2, 4, 8, 10 -> the small update; 6 -> all; 12 (the last) -> none
    assert [k for k, v in plan.items() if v == rest] == [(0, 1), (0, 3), (1, 3), (2, 1)]
    assert [k for k, v in plan.items() if v == names] == [(1, 1)]
    assert sum(map(bool, plan.values())) == 5
    assert not any(due(Exchange.parse("replica"), e, m, 3, 4, names) for e in range(3) for m in range(4))
    for bad in ("replica:last_every=-1", "replica:all_every=-2"):
        assert any(">= 0" in e for e in CodecSettings(exchange=bad).errors("cnn"))
    assert any("unknown parameter" in e for e in CodecSettings(exchange="replica:every=1").errors("cnn"))
    assert CodecSettings(exchange="replica:all_every=4").errors("cnn") == []


def test_a_partial_heads_update_moves_only_the_weights_it_names():
    _, heads = build_agent(OBS, 3, "cnn", seed=8)
    sender, receiver = WeightSync(replicated(heads)), WeightSync(replicated(heads))
    with torch.no_grad():
        for _, p in replicated(heads):
            p.add_(1e-3)
    rest = [n for n in sender.view if n not in FIRST_LAYERS]
    parts = sender.encode(replicated(heads), rest)
    assert not any(k.startswith(FIRST_LAYERS) for k in parts)
    before = {k: v.clone() for k, v in receiver.view.items()}
    for update, names in ((parts, list(sender.view)), ({**parts, "critic.0.weight.q": torch.zeros(1, dtype=torch.int8)}, rest)):
        with pytest.raises(CodecError):  # parts missing, or parts for a weight not due
            receiver.decode(update, names)
        assert all(torch.equal(receiver.view[k], before[k]) for k in before)
    view = receiver.decode(parts, rest)
    for name, p in replicated(heads):
        assert torch.equal(view[name], sender.view[name]), name
        assert torch.equal(view[name], before[name]) == (name in FIRST_LAYERS), name
    with pytest.raises(ValueError, match="no weights named"):
        sender.encode(replicated(heads), ["critic.9.weight"])


def test_a_replica_synced_every_minibatch_trains_the_encoder_as_float32_does(tmp_path):
    """One minibatch an epoch, two epochs: the second update's rollout view is stale by one
    encoder step and the once-an-iteration replica by one heads step. Synced after each
    minibatch, the replica equals the heads, and the encoder's first iteration matches
    float32 features; without the midway update it does not."""
    from ..conftest import TINY, splitrl_here

    args = TINY + ["--epochs", "2", "--minibatches", "1"]
    runs = {"fp32": [], "synced": ["--exchange", "replica:sync=fp32,all_every=1"],
            "stale": ["--exchange", "replica:sync=fp32"]}
    for name, codecs in runs.items():
        splitrl_here("train", "--run-dir", str(tmp_path / name), *args, *codecs)
    net0, _ = build_agent(OBS, 3, "cnn", seed=1)
    nets = {name: load_checkpoint(tmp_path / name, "stage0", 1)["net"] for name in runs}

    def off(name):  # relative L2 distance of the encoder's move from float32's
        diff = sum(float(((nets[name][k] - nets["fp32"][k]) ** 2).sum()) for k in nets["fp32"])
        move = sum(float(((nets["fp32"][k] - v) ** 2).sum()) for k, v in net0.state_dict().items())
        return (diff / move) ** 0.5

    assert off("synced") < 1e-4
    assert off("stale") > 1e-3  # the test can tell a stale replica from a current one


SPEC = EnvSpec(obs_shape=OBS, action_dim=3, action_low=(-1.0, 0.0, 0.0), action_high=(1.0, 1.0, 1.0))


def test_both_halves_keep_the_same_rollout_view_and_check_what_arrives():
    settings = TrainSettings(env=EnvSettings(num_envs=2), ppo=PPOSettings(num_steps=4, epochs=1, minibatches=2),
                             codecs=CodecSettings(codec_rollout="int8", exchange="replica"))
    edge, learner = Edge(settings, SPEC), Learner(settings, SPEC)
    sender, receiver = ReplicaEdge(edge), ReplicaLearner(learner)
    feats = torch.relu(torch.randn(6, 4096))
    idx = torch.arange(6)
    tensors, header = {}, {}
    edge.codecs.pack("rollout", "features", feats, Context(idx=idx), tensors, header)
    learner.codecs.unpack("rollout", "features", tensors, header, Context(idx=idx), (6, 4096), torch.float32)
    assert torch.equal(sender.view.rows(idx, (6, 4096)), receiver.view.rows(idx, (6, 4096)))
    sender.view_outputs = None  # no heads update yet: outputs on the view per minibatch
    sent, (out, _) = sender.send(receiver.view.rows(idx, (6, 4096)), idx)  # features as the rollout left them
    assert list(out) == ["outputs"] and out["outputs"].dtype == torch.float32 and out["outputs"].shape == (6, 4)
    assert torch.count_nonzero(out["outputs"]) == 0  # so the heads' outputs did not change either
    for bad in (torch.randn(6, 5), torch.full((6, 4), float("inf"))):
        with pytest.raises(CodecError):
            receiver.learn(Message("train_fwd", {}, {"outputs": bad}), idx)
    with pytest.raises(CodecError, match="no cached rollout features"):
        receiver.view.rows(torch.arange(4, 10), (6, 4096))


def test_replica_settings_name_the_exchange_and_need_the_cnn_cut():
    assert CodecSettings(exchange="replica").errors("cnn") == []
    assert CodecSettings(exchange="replica:sync=bf16", codec_fwd="bf16", codec_bwd="bf16").errors("cnn") == []
    # replica was a codec once: the old spelling is refused with the new one in the message
    for old in (CodecSettings(codec_fwd="replica"), CodecSettings(codec_bwd="replica:values=bf16")):
        assert any("use --exchange replica" in e for e in old.errors("cnn"))
    assert any("4 values a sample" in e for e in CodecSettings(exchange="replica", codec_fwd="relu").errors("cnn"))
    assert any("4 values a sample" in e for e in CodecSettings(exchange="replica", codec_bwd="bf16+zstd").errors("cnn"))
    assert CodecSettings(exchange="replica").errors("input")
    assert any("unknown exchange" in e for e in CodecSettings(exchange="copy").errors("cnn"))
    assert any("sync must be" in e for e in CodecSettings(exchange="replica:sync=int4").errors("cnn"))


def test_with_still_heads_a_replica_run_trains_the_encoder_as_float32_does(tmp_path):
    """Heads that (almost) never move keep the replica current, so the whole replica path,
    both stages' wiring included, must train the encoder as exact float32 features do."""
    from ..conftest import TINY, splitrl_here

    args = TINY + ["--lr-heads", "1e-12", "--epochs", "3"]
    runs = {"fp32": [], "replica": ["--exchange", "replica:sync=fp32"]}
    for name, codecs in runs.items():
        splitrl_here("train", "--run-dir", str(tmp_path / name), *args, *codecs)
    net0, _ = build_agent(OBS, 3, "cnn", seed=1)
    plain = load_checkpoint(tmp_path / "fp32", "stage0", 2)["net"]
    replica = load_checkpoint(tmp_path / "replica", "stage0", 2)["net"]
    for name, initial in net0.state_dict().items():
        moved = float((plain[name] - initial).abs().max())
        assert moved > 1e-5, name  # the encoder trained, so a wrong gradient would show
        assert float((replica[name] - plain[name]).abs().max()) < 0.01 * moved, name
