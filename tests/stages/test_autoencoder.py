"""--bottleneck-train autoencoder: a projection fitted to reconstruct the features, shipped to stage0."""

import dataclasses
import logging

import pytest
import torch

from splitrl.codecs import CodecError
from splitrl.models import build_agent
from splitrl.runs import load_checkpoint
from splitrl.settings import CodecSettings, ScheduleSettings, TrainSettings
from splitrl.stages.autoencoder import SAMPLE, Autoencoder, pack_sample, unpack_sample
from splitrl.stages.replica import folded, replica_weights
from splitrl.stages.replica_plan import FIRST_LAYERS, replicated
from splitrl.transport.wire import Message

from ..conftest import TINY, splitrl_here, train_in_process

OBS = (4, 96, 96)


def _agent(k=16, seed=5):
    return build_agent(OBS, 3, "cnn", seed=seed, bottleneck=k, autoencoder=True)


def test_the_heads_take_the_decoders_reconstruction_and_only_the_fit_moves_projection_and_decoder():
    net, heads = _agent()
    projection, decoder = net[-1], heads.trunk[-1]
    assert heads.input_dim == 16 and heads.critic[0].in_features == 4096
    # Started as an orthogonal projection and its transpose: the code reconstructs its own subspace exactly.
    f = torch.randn(5, 4096)
    again = decoder(projection(decoder(projection(f))))
    assert torch.allclose(again, decoder(projection(f)), atol=1e-4)
    obs = torch.randint(0, 256, (2,) + OBS, dtype=torch.uint8)
    mean, value = heads.outputs(net(obs))
    (mean.sum() + value.sum()).backward()
    assert projection.weight.grad is None and decoder.weight.grad is None  # PPO's loss leaves them alone...
    assert net[1].weight.grad is not None and heads.critic[0].weight.grad is not None  # ...and reaches the CNN


def test_the_replica_is_the_heads_with_the_decoder_folded_in():
    _, heads = _agent()
    with torch.no_grad():
        heads.trunk[-1].bias.normal_()  # a fitted decoder has a bias
        heads.critic[0].bias.normal_()
    replica = folded(heads)
    assert replica.critic[0].in_features == 16 and len(replica.trunk) == 0
    z = torch.randn(7, 16)
    for got, want in zip(replica.outputs(z), heads.outputs(z)):
        assert torch.allclose(got, want, atol=1e-4)
    assert {name for name, _ in replicated(replica)} == set(replica_weights(heads))
    # A mid-iteration update without the first layers folds only the biases (cheap), the same as in full.
    some = replica_weights(heads, ["critic.0.bias", "actor_mean.0.bias"])
    assert not set(FIRST_LAYERS) & set(some)
    assert torch.equal(some["critic.0.bias"], replica_weights(heads)["critic.0.bias"])
    # Without a decoder the replica is the heads themselves.
    _, plain = build_agent(OBS, 3, "cnn", seed=5, bottleneck=16)
    assert all(torch.equal(t, dict(replicated(plain))[name]) for name, t in replica_weights(plain).items())


def test_a_fit_learns_the_features_subspace():
    net, heads = _agent(k=8)
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(8, 4096, generator=g)
    ae = Autoencoder(net[-1], heads.trunk[-1], seed=1)
    first = torch.randn(256, 8, generator=g) @ basis  # features that lie in an 8-dimensional subspace
    with torch.no_grad():
        error = (heads.trunk[-1](net[-1](first)) - first).pow(2).sum(1).mean()
    assert error / first.var(dim=0, unbiased=False).sum() > 0.9  # a random 8 of 4096 directions: nearly nothing
    explained = []
    for rollout in range(3):
        ae.add(first if rollout == 0 else torch.randn(256, 8, generator=g) @ basis)
        explained.append(ae.fit()["autoencoder/explained"])
    assert explained[-1] > 0.95
    assert not any(p.requires_grad for p in ae.params)  # back out of PPO's way after each fit
    assert len(ae.replay) == 3


def test_samples_travel_int8_and_a_wrong_shape_is_refused():
    x = torch.rand(4, 4096)
    tensors, header = {}, {}
    pack_sample(x, tensors, header)
    assert all(name.startswith(SAMPLE) for name in tensors)
    msg = Message("step", header, tensors)
    back = unpack_sample(msg, 4, 4096)
    assert (back - x).abs().max() < 1 / 127
    with pytest.raises(CodecError):
        unpack_sample(msg, 2, 4096)


@pytest.mark.parametrize("change, message", [
    ({"bottleneck": 0}, "needs --bottleneck K"),
    ({"codecs": CodecSettings()}, "needs --exchange replica"),
    ({"schedule": ScheduleSettings(edges=2)}, "runs one edge"),
    ({"autoencoder_every": 0}, "--autoencoder-every must be >= 1"),
    ({"bottleneck_train": "pca"}, "--bottleneck-train must be one of"),
    ({"codecs": CodecSettings(exchange="replica", link_budget="2mbit")}, "cannot run with --link-budget"),
    ({"bottleneck_train": "ppo", "autoencoder_every": 8}, "applies to --bottleneck-train autoencoder only"),
])
def test_settings_it_cannot_run_with_are_refused(change, message):
    good = TrainSettings(bottleneck=16, bottleneck_train="autoencoder", codecs=CodecSettings(exchange="replica"))
    assert good.errors() == []
    assert any(message in e for e in dataclasses.replace(good, **change).errors())


assert TINY[:2] == ["--total-steps", "64"]
AUTOENCODER = TINY[2:] + ["--bottleneck", "32", "--bottleneck-train", "autoencoder", "--autoencoder-every", "4",
                          "--codec-rollout", "int8", "--exchange", "replica:last_every=1,all_every=3"]


def test_a_resumed_run_fits_on_as_it_would_have(tmp_path, caplog):
    """The fit's replay, optimizer and generator are in stage1's checkpoint: 2 iterations, then 2 more with
    --resume, end where 4 straight do (the projection stage0 got, the decoder, the heads)."""
    def train(*args):
        done = train_in_process(*args, *AUTOENCODER)
        assert done.exit_code == 0, done.output[-3000:]
        return done.output

    train("--run-dir", str(tmp_path / "straight"), "--total-steps", "128")
    train("--run-dir", str(tmp_path / "resumed"), "--total-steps", "64")
    caplog.set_level(logging.INFO)
    train("--resume", str(tmp_path / "resumed"), "--total-steps", "128")
    assert "resuming after iteration 2" in caplog.text
    for stage, key in (("stage0", "net"), ("stage1", "heads"), ("stage1", "autoencoder")):
        straight, resumed = (load_checkpoint(tmp_path / run, stage, 4)[key] for run in ("straight", "resumed"))
        for name in ("projection",) if key == "autoencoder" else straight:
            assert torch.equal(straight[name], resumed[name]), f"{stage}.{key}.{name}"
    # stage0's projection is the one stage1 fitted (up to the int8 sync of its change), not its seed's.
    net, start = load_checkpoint(tmp_path / "straight", "stage0", 4)["net"], _agent(k=32, seed=1)[0]
    fitted = load_checkpoint(tmp_path / "straight", "stage1", 4)["autoencoder"]["projection"]
    name = [n for n in net if n.endswith(".weight")][-1]
    assert not torch.equal(net[name], start[-1].weight)
    assert (net[name] - fitted).abs().max() < 0.05 * fitted.abs().max()
    # And the checkpoints play: `splitrl eval` builds both stages' networks, decoder and all, from them.
    splitrl_here("eval", str(tmp_path / "straight"), "--episodes", "1", "--threads", "1", "--record")
    assert (tmp_path / "straight" / "eval.jsonl").read_text().count("\n") == 2  # greedy and sampled
