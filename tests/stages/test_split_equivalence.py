"""The split network and the twin compute exactly what the unsplit network does."""

import copy
import json

import pytest
import torch

from splitrl.launch import free_port_pair
from splitrl.models import build_agent
from splitrl.ppo import ppo_loss
from splitrl.runs import load_checkpoint
from splitrl.transport.local import LocalTransport

from ..conftest import TINY, splitrl_here


def test_split_gradients_equal_unsplit_gradients():
    torch.manual_seed(0)
    net0, heads = build_agent((4, 96, 96), 3, "cnn", seed=5)
    whole0, whole_heads = copy.deepcopy(net0), copy.deepcopy(heads)
    obs = torch.randint(0, 256, (16, 4, 96, 96), dtype=torch.uint8)
    actions = torch.randn(16, 3)
    old_logprob, adv, old_values, returns = torch.randn(16), torch.randn(16), torch.randn(16), torch.randn(16)

    def loss_of(head_module, x):
        _, logprob, entropy, value = head_module.get_action_and_value(x, actions)
        return ppo_loss(logprob, old_logprob, adv, value, old_values, returns, entropy)[0]

    # Unsplit: one autograd graph.
    loss_of(whole_heads, whole0(obs)).backward()

    # Split: features and gradients cross a real (in-process) link as wire frames.
    a, b = LocalTransport.pair("stage0", "stage1")
    features = net0(obs)
    a.send("train_fwd", {"features": features.detach()})
    received = b.recv().tensors["features"].requires_grad_()
    loss_of(heads, received).backward()
    b.send("train_bwd", {"grad": received.grad})
    torch.autograd.backward(features, a.recv().tensors["grad"])

    for (name, p), (_, q) in zip(list(net0.named_parameters()) + list(heads.named_parameters()),
                                 list(whole0.named_parameters()) + list(whole_heads.named_parameters())):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_a_bottleneck_is_a_learned_projection_at_the_end_of_stage0_and_narrows_the_heads():
    net0, heads = build_agent((4, 96, 96), 3, "cnn", seed=5, bottleneck=64)
    plain0, plain_heads = build_agent((4, 96, 96), 3, "cnn", seed=5)
    obs = torch.randint(0, 256, (2, 4, 96, 96), dtype=torch.uint8)
    features = net0(obs)
    assert features.shape == (2, 64) and bool((features < 0).any())  # no ReLU after the projection
    assert heads.critic[0].in_features == heads.actor_mean[0].in_features == 64
    assert plain_heads.critic[0].in_features == 4096
    torch.testing.assert_close(net0[:-1](obs), plain0(obs), rtol=0, atol=0)  # the same CNN before it
    projection = net0[-1].weight
    torch.testing.assert_close(projection @ projection.T, torch.eye(64), atol=1e-5, rtol=0)  # orthogonal rows
    whole, _ = build_agent((4, 96, 96), 3, "input", seed=5, bottleneck=64)
    assert len(whole) == 0  # the cloud setup: stage1 holds the projection too


def _load(run_dir, stage):
    return load_checkpoint(run_dir, stage, 2)


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Wall-clock and CPU-time figures differ between runs by nature; everything else must not.
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cpu/")) and k != "charts/SPS"} for r in rows]


# Lossless codecs change the bytes, never the numbers: the ReLU-sparse features are
# exact, and error feedback at full density in float32 sends every gradient entry
# that stage0's ReLU lets through; frames rebuild the pixel stacks exactly.
LOSSLESS = ["--codec-rollout", "relu+zstd", "--codec-fwd", "relu", "--codec-bwd", "ef:density=1,values=fp32"]
# Lossy, so only split against twin: the heads' replica and its updates are the same on both.
REPLICA = ["--codec-rollout", "int8", "--exchange", "replica"]
# With updates during training too (TINY: 4 minibatches an iteration: small, small, all, none).
REPLICA_SYNC = ["--codec-rollout", "int8", "--exchange", "replica:last_every=1,all_every=3"]
# A learned projection to 32 values at the end of stage0 (a different network: split against twin only).
BOTTLENECK = ["--bottleneck", "32", "--codec-rollout", "int8", "--codec-bwd", "ef:density=0.5,values=int8"]
BOTTLENECK_REPLICA = ["--bottleneck", "32", "--codec-rollout", "int8", "--exchange", "replica:last_every=1,all_every=3"]
# The projection fitted on stage1 as an autoencoder's encoder half, sent with the replica's updates.
AUTOENCODER = BOTTLENECK_REPLICA + ["--bottleneck-train", "autoencoder", "--autoencoder-every", "4"]
CHANNELS_LAST = ["--channels-last"]  # another layout inside the convolutions: the twin's with it, not the plain run's


@pytest.fixture(scope="module")
def twin_of(tmp_path_factory):
    """The twin's run directory for given training arguments, run once per set of arguments (the transport is
    not one of them: several cases share a twin, and a lossless codec's plain baseline is the plain case's).
    The twin trains in this process: the process boundary is the split run's, not the twin's."""
    runs: dict[tuple[str, ...], object] = {}

    def run(args: list[str]):
        key = tuple(args)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("twin")
            splitrl_here("train", "--run-dir", str(run_dir), "--overwrite", *args)
            runs[key] = run_dir
        return runs[key]

    return run


@pytest.mark.parametrize(
    "cut, transport, codecs",
    [("cnn", "zmq", []), ("input", "zmq", []), ("cnn", "tcp", []), ("cnn", "torch-rpc", []), ("cnn", "zmq", LOSSLESS),
     ("input", "tcp", ["--codec-rollout", "frames"]), ("cnn", "zmq", REPLICA),
     ("cnn", "zmq", REPLICA_SYNC), ("cnn", "zmq", BOTTLENECK), ("cnn", "zmq", BOTTLENECK_REPLICA),
     ("cnn", "zmq", AUTOENCODER), ("cnn", "zmq", CHANNELS_LAST)],
    ids=["cnn-zmq", "input-zmq", "cnn-tcp", "cnn-torch-rpc", "cnn-zmq-lossless-codecs", "input-tcp-frames",
         "cnn-zmq-replica", "cnn-zmq-replica-sync", "cnn-zmq-bottleneck", "cnn-zmq-bottleneck-replica",
         "cnn-zmq-autoencoder", "cnn-zmq-channels-last"],
)
def test_split_over_tcp_matches_twin_bit_for_bit(tmp_path, spawn, twin_of, cut, transport, codecs):
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    args = TINY + ["--cut", cut, "--timeout", "60", "--start-timeout", "60", *codecs]
    split_dir = tmp_path / "split"
    s1 = spawn("stage1", "--bind", endpoint, "--run-dir", str(split_dir), "--transport", transport, *args)
    s0 = spawn("stage0", "--connect", endpoint, "--run-dir", str(split_dir), "--transport", transport, *args)
    code0, out0 = s0.finish(timeout=240)
    code1, out1 = s1.finish(timeout=30)
    assert code0 == 0, out0
    assert code1 == 0, out1
    twin_dir = twin_of(args)

    for stage, key in (("stage0", "net"), ("stage1", "heads")):
        split_state, twin_state = _load(split_dir, stage)[key], _load(twin_dir, stage)[key]
        assert split_state.keys() == twin_state.keys()
        for name in split_state:
            assert torch.equal(split_state[name], twin_state[name]), f"{stage}.{name}"
    if codecs and codecs not in (REPLICA, REPLICA_SYNC, BOTTLENECK, BOTTLENECK_REPLICA, AUTOENCODER,
                                 CHANNELS_LAST):  # lossless codecs must match the plain run
        plain_dir = twin_of(args[: -len(codecs)])
        for stage, key in (("stage0", "net"), ("stage1", "heads")):
            plain = _load(plain_dir, stage)[key]
            for name, value in _load(twin_dir, stage)[key].items():
                assert torch.equal(value, plain[name]), f"codecs changed {stage}.{name}"
    if codecs == CHANNELS_LAST:  # it reached the encoder: its weights are the plain run's to float32 rounding only
        plain = _load(twin_of(args[:-1]), "stage0")["net"]
        trained = _load(twin_dir, "stage0")["net"]
        assert not all(torch.equal(value, plain[name]) for name, value in trained.items())
        for name, value in trained.items():
            torch.testing.assert_close(value, plain[name], rtol=1e-4, atol=1e-6)
    split_metrics, twin_metrics = _metrics(split_dir), _metrics(twin_dir)
    assert len(split_metrics) == 2
    assert split_metrics == twin_metrics
    # The cut decides the traffic: training crosses the link only when stage0 holds layers.
    trained_remotely = "net/train_fwd/sent_bytes" in split_metrics[-1]
    assert trained_remotely == (cut == "cnn")
    assert split_metrics[-1]["net/step/sent_bytes"] > 0
    episodes = (split_dir / "episodes.jsonl").read_text().splitlines()
    assert len(episodes) == 3  # 64 steps, time limit 20: three truncated episodes
