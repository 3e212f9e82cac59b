"""Observations beyond stacked frames through both stages: a state vector (CartPole) and a Dict of an image and a
vector (splitrl/PickByCue-v0): what crosses the link, split == twin bit for bit, and a Dict run that learns."""

import json

import numpy as np
import pytest
import torch

from splitrl.envs import inspect_env
from splitrl.settings import EnvSettings, PPOSettings, TrainSettings
from splitrl.stages import Edge, Learner
from splitrl.transport import wire
from splitrl.transport.wire import Message

from ..conftest import train_in_process
from ..models.twin import split_matches_twin

CARTPOLE = ["--env-id", "CartPole-v1", "--model", "mlp", "--hidden", "16"]
PICK = ["--env-id", "splitrl/PickByCue-v0", "--model", "impala", "--model-kwargs", "width=4,blocks=0,features=16",
        "--hidden", "16"]


@pytest.mark.parametrize("env_id, dtype, row", [("CartPole-v1", torch.float32, (4,)),
                                                ("splitrl/PickByCue-v0", torch.uint8, (3 * 16 * 16 + 4 * 2,))],
                         ids=["vector", "dict"])
def test_with_the_cut_at_the_input_the_observations_cross_as_they_are_and_are_counted_so(env_id, dtype, row):
    settings = TrainSettings(env=EnvSettings(env_id=env_id, num_envs=2), cut="input", hidden=16,
                             model_kwargs="" if env_id == "CartPole-v1" else "width=4,blocks=0,features=16",
                             model="auto" if env_id == "CartPole-v1" else "impala",
                             ppo=PPOSettings(num_steps=3, epochs=1, minibatches=1))
    spec = inspect_env(settings.env)
    edge, learner = Edge(settings, spec), Learner(settings, spec)
    edge.open_envs()
    try:
        edge.begin_rollout(1)
        learner.begin_rollout(1)
        for t in range(3):
            raw = edge.envs.next_obs[0]
            tensors, header = edge.observe(t)
            sent = tensors["features"]
            assert sent.dtype == dtype and sent.shape == (2, *row)
            if dtype == torch.float32:  # CartPole's state itself, float32, 4 bytes a value on the wire
                assert torch.equal(sent, torch.as_tensor(raw, dtype=torch.float32))
            else:  # the image's bytes, then the cue's float32 values as bytes
                assert torch.equal(sent[:, 768:].contiguous().view(torch.float32), torch.as_tensor(raw["cue"]))
            frames = wire.encode("step", t, header, tensors)
            assert wire.frame_nbytes(frames[1 + list(tensors).index("features")]) == 2 * int(np.prod(row)) * (
                4 if dtype == torch.float32 else 1)
            action, _ = learner.act(t, wire.decode(frames))
            assert torch.equal(learner.rollouts.inputs[0][t], sent)  # stage1 keeps what it was sent, exactly
            edge.step(Message("action", {}, action))
    finally:
        edge.close()


@pytest.mark.parametrize("extra", [[], ["--cut", "input"]], ids=["cut-after-mlp", "cut-input"])
def test_a_vector_env_trains_split_and_twin_bit_identically(tmp_path, spawn, extra):
    metrics = split_matches_twin(tmp_path, spawn, *CARTPOLE, "--total-steps", "256", "--num-steps", "64",
                                 "--num-envs", "2", *extra)
    config = json.loads((tmp_path / "split" / "config-stage0.json").read_text())
    assert config["env_spec"]["observation"] == "vector" and config["env_spec"]["obs_shape"] == [4]
    assert config["settings"]["env"]["frame_stack"] == 1 and config["settings"]["env"]["grayscale"] is False
    assert ("net/train_fwd/sent_bytes" in metrics[-1]) == (not extra)


@pytest.mark.parametrize("extra", [[], ["--cut", "input"]], ids=["cut-at-join", "cut-input"])
def test_a_dict_env_trains_split_and_twin_bit_identically(tmp_path, spawn, extra):
    metrics = split_matches_twin(tmp_path, spawn, *PICK, *extra)
    config = json.loads((tmp_path / "split" / "config-stage0.json").read_text())
    assert config["env_spec"]["observation"] == "dict" and config["env_spec"]["keys"] == ["image", "cue"]
    assert ("net/train_fwd/sent_bytes" in metrics[-1]) == (not extra)


def _returns(run_dir):
    return [json.loads(line)["return"] for line in (run_dir / "episodes.jsonl").read_text().splitlines()]


def test_a_dict_env_learns_to_use_both_the_image_and_the_vector(tmp_path):
    """Chance is 2 of 8 picks an episode; the image alone or the cue alone give at most 4 and 2 (tests/
    test_pick_by_cue.py). A short run ends above what either half can give."""
    train_in_process("--env-id", "splitrl/PickByCue-v0", "--model", "impala", "--model-kwargs",
                     "width=8,blocks=0,features=64", "--hidden", "64", "--num-envs", "4", "--num-steps", "64",
                     "--minibatches", "4", "--epochs", "4", "--total-steps", "12288", "--lr-encoder", "1e-3",
                     "--lr-heads", "1e-3", "--gamma", "0", "--ent-coef", "0.01", "--no-norm-reward", "--vector", "sync",
                     "--threads", "1", "--checkpoint-every", "0", "--run-dir", str(tmp_path / "run"))
    returns = _returns(tmp_path / "run")
    assert np.mean(returns[:20]) < 3.5 and np.mean(returns[-20:]) > 4.5, (returns[:20], returns[-20:])
