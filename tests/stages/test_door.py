"""A fleet's stage1 at its door (`splitrl.stages.door`): every kind of message an edge sends, as a real edge
sends it, is let in; one of the wrong width, the wrong dtype, a tensor short or a tensor over is turned away
with an error naming the kind, the tensor, what was expected and what came."""

import dataclasses

import pytest
import torch

from splitrl.codecs import CodecSet, Context
from splitrl.envs import inspect_env
from splitrl.settings import CodecSettings, EnvSettings, PPOSettings, ScheduleSettings, TrainSettings
from splitrl.stages import Edge, FeaturesEdge, Learner
from splitrl.stages.door import Door
from splitrl.transport import ProtocolError, wire
from splitrl.transport.wire import Message

SETTINGS = TrainSettings(env=EnvSettings(env_id="CartPole-v1", num_envs=2, max_episode_steps=2), model="mlp",
                         hidden=16, ppo=PPOSettings(num_steps=3, epochs=1, minibatches=2),
                         schedule=ScheduleSettings(edges=2))
"""Two edges of two CartPoles each; episodes cut after 2 steps, so the third step carries final features."""


def _received(kind, tensors=None, header=None):
    """The message as stage1 receives it: through the wire's encoding and decoding."""
    return wire.decode(wire.encode(kind, 0, header or {}, tensors))


def _fleet(codec="fp32", sync="grad"):
    """Edge 1 of the fleet and stage1's door for it, the rollout and training features through ``codec``."""
    settings = dataclasses.replace(SETTINGS, codecs=CodecSettings(codec_rollout=codec, codec_fwd=codec),
                                   schedule=dataclasses.replace(SETTINGS.schedule, encoder_sync=sync))
    spec = inspect_env(settings.env)
    return Edge(settings, spec, edge=1), Door(Learner(settings.fleet_view(), spec), settings.env.num_envs)


def _rollout(edge):
    """Edge ``edge``'s steps and rollout_end as it sends them (every action 0)."""
    edge.open_envs()
    try:
        edge.begin_rollout(1)
        msgs = []
        for t in range(edge.settings.ppo.num_steps):
            tensors, header = edge.observe(t)
            msgs.append(_received("step", tensors, {**header, "t": t}))
            edge.step(Message("action", {}, {"action": torch.zeros(2, dtype=torch.int64)}))
        msgs.append(_received("rollout_end", *edge.end_rollout()))
    finally:
        edge.close()
    return msgs


def _train_fwd(edge):
    """Edge ``edge``'s share of the first minibatch it holds samples of (their number) and its train_fwd."""
    fleet_idx, rows = next(share for idx in edge.begin_training(1)[0] if len((share := edge.own(idx))[0]))
    _, (tensors, header) = FeaturesEdge(edge).send(edge.forward(rows), fleet_idx)
    return len(rows), _received("train_fwd", tensors, {**header, "epoch": 0, "mb": 0})


def _with(msg, **tensors):
    """``msg`` with ``tensors`` put in (None: taken out)."""
    out = {**msg.tensors, **tensors}
    return dataclasses.replace(msg, tensors={k: v for k, v in out.items() if v is not None})


def _turned_away(door, msg, words, rows=None):
    with pytest.raises(ProtocolError) as caught:
        door.check(msg, rows)
    assert words in str(caught.value), str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "relu", "relu:values=int8", "int8+zstd", "bf16+zstd"])
def test_the_door_lets_in_an_edges_rollout_and_training_features_through_any_fleet_codec(codec):
    """Every step (the third with a truncated episode's final features), the rollout_end and a train_fwd, as the
    edge packs them; the same features one wider are turned away (a bitmask's bytes, the zstd layout's claim)."""
    edge, door = _fleet(codec)
    msgs = _rollout(edge)
    assert "final_index" in msgs[2].tensors  # the episodes were cut: their final observations' features came
    for msg in msgs:
        door.check(msg)
    rows, fwd = _train_fwd(edge)
    door.check(fwd, rows)
    wider, header = {}, {"t": 0}
    CodecSet(rollout=codec).pack("rollout", "features", torch.rand(2, door.learner.feature_dim + 1),
                                 Context(idx=torch.arange(2), envs=torch.arange(2)), wider, header)
    _turned_away(door, _received("step", wider, header), "step: tensor 'features")


def test_a_step_of_the_wrong_width_or_dtype_or_a_tensor_short_or_over_is_turned_away():
    edge, door = _fleet()
    first, later, truncated, end = _rollout(edge)
    width = door.learner.feature_dim
    features = first.tensors["features"]
    assert _turned_away(door, _with(first, features=torch.zeros(2, width + 1)), "tensor 'features'") == \
        f"step: tensor 'features': expected float32 [2, {width}], got float32 [2, {width + 1}]"
    assert _turned_away(door, _with(first, features=features.half()), "tensor 'features'") == \
        f"step: tensor 'features': expected float32 [2, {width}], got float16 [2, {width}]"
    _turned_away(door, _with(first, features=features[:1]), "expected float32 [2, ")  # one env's rows short
    _turned_away(door, _with(first, features=None), "tensor 'features': expected float32")
    _turned_away(door, _with(later, reward=None), "step: tensor 'reward': expected float32 [2], got none")
    _turned_away(door, _with(later, terminated=later.tensors["terminated"].float()), "tensor 'terminated': "
                 "expected bool [2], got float32 [2]")
    _turned_away(door, _with(first, reward=torch.zeros(2)), "step: unexpected tensor 'reward'")  # t = 0: no outcome
    _turned_away(door, _with(later, extra=torch.zeros(1)), "step: unexpected tensor 'extra'")
    _turned_away(door, _with(truncated, final_index=torch.tensor([0, 1, 2])), "tensor 'final_index': expected int64")
    _turned_away(door, _with(truncated, final_index=truncated.tensors["final_index"] + 5), "env indices in [0, 2)")
    _turned_away(door, _with(truncated, final_index=None), "unexpected tensor 'final_features'")
    _turned_away(door, dataclasses.replace(first, header={**first.header, "budget": {}}), "header 'budget'")


def test_a_rollout_end_must_carry_its_features_and_the_last_outcome():
    edge, door = _fleet()
    end = _rollout(edge)[-1]
    _turned_away(door, _with(end, features=torch.zeros(2, 3)), "rollout_end: tensor 'features'")
    _turned_away(door, _with(end, truncated=None), "rollout_end: tensor 'truncated': expected bool [2], got none")
    _turned_away(door, _with(end, reward=end.tensors["reward"].to(torch.float16)), "tensor 'reward'")
    _turned_away(door, _with(end, more=torch.zeros(2)), "rollout_end: unexpected tensor 'more'")


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_train_fwd_must_carry_the_edges_share_of_the_minibatch(codec):
    edge, door = _fleet(codec)
    _rollout(edge)
    rows, fwd = _train_fwd(edge)
    name = "features" if codec == "fp32" else "features.q"
    dtype = torch.float32 if codec == "fp32" else torch.int8
    _turned_away(door, fwd, f"train_fwd: tensor '{name}'", rows=rows + 1)  # one sample more than its share
    width = door.learner.feature_dim
    _turned_away(door, _with(fwd, **{name: torch.zeros(rows, width - 1, dtype=dtype)}),
                 f"expected {str(dtype)[6:]} [{rows}, {width}], got {str(dtype)[6:]} [{rows}, {width - 1}]", rows)
    _turned_away(door, _with(fwd, **{name: fwd.tensors[name].to(torch.int16)}), f"tensor '{name}'", rows)
    _turned_away(door, _with(fwd, **{name: None}), f"train_fwd: tensor '{name}'", rows)
    _turned_away(door, _with(fwd, labels=torch.zeros(rows)), "train_fwd: unexpected tensor 'labels'", rows)


def test_an_encoder_grad_must_carry_every_parameter_of_the_encoder_as_it_is():
    edge, door = _fleet()
    msg = _received("encoder_grad", edge.gradients(), {"epoch": 0, "mb": 0})
    door.check(msg)
    name, grad = next(iter(msg.tensors.items()))
    _turned_away(door, _with(msg, **{name: None}), f"encoder_grad: tensor '{name}': expected float32")
    _turned_away(door, _with(msg, **{name: grad[..., :-1]}), f"encoder_grad: tensor '{name}': expected float32")
    _turned_away(door, _with(msg, **{name: grad.to(torch.bfloat16)}), "got bfloat16")
    _turned_away(door, _with(msg, **{"encoder.extra": torch.zeros(1)}), "unexpected tensor 'encoder.extra'")


@pytest.mark.parametrize("mode", ["int8", "fp32"])
def test_an_encoder_avg_must_carry_every_parameters_change_through_the_averages_codec(mode):
    edge, door = _fleet(sync=f"avg:sync={mode}")
    msg = _received("encoder_avg", edge.encoder_change(mode), {"epoch": 0, "mb": 0})
    door.check(msg)
    name, change = next(iter(msg.tensors.items()))  # int8: a weight's codes (its scales follow); fp32: the change
    _turned_away(door, _with(msg, **{name: None}), f"encoder_avg: tensor '{name}'")
    _turned_away(door, _with(msg, **{name: change[:1]}), f"encoder_avg: tensor '{name}'")
    _turned_away(door, _with(msg, **{name: change.to(torch.float16)}), "got float16")
    _turned_away(door, _with(msg, **{"encoder.x": torch.zeros(1)}), "unexpected tensor 'encoder.x'")


def test_an_encoder_state_must_carry_the_encoder_and_its_moments_once_it_stepped():
    edge, door = _fleet()
    tensors, header = edge.encoder_state()
    fresh = _received("encoder_state", tensors, {**header, "iteration": 1})
    door.check(fresh)  # no step yet: the weights alone
    sum(p.square().sum() for p in edge.net.parameters()).backward()
    edge.optimizer_step()
    tensors, header = edge.encoder_state()
    stepped = _received("encoder_state", tensors, {**header, "iteration": 1})
    door.check(stepped)
    moment = next(name for name in stepped.tensors if name.startswith("exp_avg."))
    _turned_away(door, _with(stepped, **{moment: None}), f"encoder_state: tensor '{moment}'")
    _turned_away(door, dataclasses.replace(fresh, header={**fresh.header, "adam_step": 1}), "tensor 'exp_avg.")
    weight = next(iter(fresh.tensors))
    _turned_away(door, _with(fresh, **{weight: fresh.tensors[weight][:1]}), f"encoder_state: tensor '{weight}'")
    _turned_away(door, _with(fresh, **{weight: fresh.tensors[weight].half()}), "got float16")
    _turned_away(door, _with(fresh, bias=torch.zeros(1)), "unexpected tensor 'bias'")
    _turned_away(door, dataclasses.replace(fresh, header={**fresh.header, "global_step": -1}), "'global_step'")


@pytest.mark.parametrize("sync", ["grad", "avg"])
def test_iter_end_and_close_carry_no_tensors_and_iter_end_says_true_or_false_with_the_encoders_digests(sync):
    """``iter_end``'s ``encoder``: a digest of each weight (and, with ``grad``, of each of Adam's moments), 32 hex
    digits each, as the edge makes them once it has stepped."""
    edge, door = _fleet(sync=sync)
    sum(p.square().sum() for p in edge.net.parameters()).backward()
    edge.optimizer_step()
    digests = edge.fleet.digests(moments=sync == "grad")
    assert any(name.startswith("exp_avg.") for name in digests) == (sync == "grad")
    assert all(name.startswith(("net.", "exp_avg.", "exp_avg_sq.")) for name in digests)
    end = _received("iter_end", None, {"iteration": 1, "checkpoint": True, "eval": False, "encoder": digests})
    door.check(end)
    door.check(_received("close"))
    _turned_away(door, _with(end, features=torch.zeros(2, 3)), "iter_end: unexpected tensor 'features' (expected none)")
    _turned_away(door, _received("close", {"x": torch.zeros(1)}), "close: unexpected tensor 'x'")
    _turned_away(door, dataclasses.replace(end, header={**end.header, "eval": "yes"}), "header 'eval': expected true")
    _turned_away(door, _received("action", {"action": torch.zeros(2)}), "not a message an edge of a fleet sends")
    name = next(iter(digests))
    for bad in ({**digests, name: digests[name][:-1]}, {**digests, name: digests[name].upper()},
                {**digests, name: 7}):
        _turned_away(door, dataclasses.replace(end, header={**end.header, "encoder": bad}),
                     f"header 'encoder': {name!r}: expected 32 hex digits")
    for bad in ({k: v for k, v in digests.items() if k != name}, {**digests, "net.x": digests[name]}, None,
                {**digests, b"net.x": digests[name]}):  # (a bytes key beside str ones: named, not a TypeError)
        _turned_away(door, dataclasses.replace(end, header={**end.header, "encoder": bad}),
                     f"header 'encoder': expected a digest of each of {len(digests)} tensors")
