"""The built-in models: their layers' names and output shapes on CarRacing's (4, 84, 84) uint8 observations, and
IMPALA's encoder trained split as its single-process twin trains it."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from splitrl.errors import SettingsError
from splitrl.models import build_agent, make_network, spaces

from .twin import split_matches_twin

OBS = (4, 84, 84)


def _shapes(model, **kwargs):
    obs, act = spaces(OBS, 3)
    network = make_network(model, kwargs, obs, act)
    return list(zip(["input"] + network.names, network.shapes(obs)))


def test_nature_layers_and_shapes():
    assert _shapes("nature") == [("input", OBS), ("scale", OBS), ("conv1", (32, 20, 20)), ("relu1", (32, 20, 20)),
                                 ("conv2", (64, 9, 9)), ("relu2", (64, 9, 9)), ("conv3", (64, 7, 7)),
                                 ("relu3", (64, 7, 7)), ("flatten", (3136,))]


def test_impala_layers_and_shapes():
    assert _shapes("impala") == [("input", OBS), ("scale", OBS), ("stack1", (16, 42, 42)), ("stack2", (32, 21, 21)),
                                 ("stack3", (32, 11, 11)), ("flatten", (3872,)), ("fc", (256,))]
    assert _shapes("impala", width=4, blocks=1, features=32)[-3:] == [("stack3", (8, 11, 11)), ("flatten", (968,)),
                                                                       ("fc", (32,))]
    obs, act = spaces(OBS, 3)
    stack = make_network("impala", {}, obs, act).modules[1]
    assert sum(type(m).__name__ == "ResidualBlock" for m in stack) == 2  # two residual blocks a stack


def test_impala_cut_inside_crosses_its_feature_map_flat():
    kwargs = {"width": 4, "blocks": 1, "features": 32}
    encoder, heads = build_agent(OBS, 3, "stack2", seed=1, model="impala", model_kwargs=kwargs)
    whole_encoder, whole_heads = build_agent(OBS, 3, "input", seed=1, model="impala", model_kwargs=kwargs)
    x = torch.randint(0, 256, (2,) + OBS, dtype=torch.uint8)
    crossing = encoder(x)
    assert crossing.shape == (2, 8 * 21 * 21) and heads.input_dim == 8 * 21 * 21 and heads.critic[0].in_features == 32
    for got, want in zip(heads.outputs(crossing), whole_heads.outputs(x)):
        assert torch.equal(got, want)


def test_mlp_layers_and_shapes_on_vectors_and_its_refusal_of_images():
    obs = gym.spaces.Box(-np.inf, np.inf, (11,), np.float32)
    network = make_network("mlp", {"width": 32, "depth": 3}, obs, gym.spaces.Box(-1, 1, (3,), np.float32))
    assert network.names == ["fc1", "fc2", "fc3"] and network.shapes(obs) == [(11,), (32,), (32,), (32,)]
    with pytest.raises(SettingsError) as info:
        build_agent(OBS, 3, "cnn", seed=1, model="mlp")
    message = str(info.value)
    assert message == "model 'mlp' needs a 1-d Box observation (a state vector), got Box(0, 255, (4, 84, 84), uint8)"
    assert "\n" not in message


def test_a_builtins_bad_kwargs_are_one_line():
    with pytest.raises(SettingsError, match=r"^model 'impala': width must be a whole number >= 1, got 0$"):
        build_agent(OBS, 3, "cnn", seed=1, model="impala", model_kwargs={"width": 0})


SMALL = ["--resize", "36"]  # 36 x 36 frames: nature's maps are 8 x 8, 3 x 3 and 1 x 1; impala's 18, 9 and 5
CUTS = [("nature", cut) for cut in ("input", "conv1", "relu1", "conv2", "relu2", "conv3", "relu3", "cnn")] + [
    ("impala", cut) for cut in ("input", "stack1", "stack2", "stack3", "flatten", "cnn")]


CODECS = {  # a feature map through the codecs: lossless ones, and lossy ones (the twin codes alike)
    ("nature", "relu1"): ["--codec-rollout", "relu+zstd", "--codec-fwd", "relu", "--codec-bwd", "ef:density=1,values=fp32"],
    ("nature", "conv2"): ["--codec-rollout", "int8", "--codec-fwd", "delta", "--codec-bwd", "ef:density=0.5,values=int8"],
    ("impala", "stack2"): ["--codec-rollout", "bf16", "--codec-bwd", "ef:density=0.05"],
}


@pytest.mark.parametrize("model, cut", CUTS, ids=[f"{m}-{c}" for m, c in CUTS])
def test_every_cut_of_the_builtins_trains_split_as_its_twin(tmp_path, spawn, model, cut):
    """Every boundary with parameters before it ('scale' has none); 'cnn' is each model's default (after
    'flatten' for nature, after 'fc' for impala). What crosses in training is the activation at the cut, flat;
    three cuts inside the encoders send it through other codecs than fp32."""
    kwargs = ["--model-kwargs", "width=4,blocks=1,features=32"] if model == "impala" else []
    metrics = split_matches_twin(tmp_path, spawn, "--model", model, *kwargs, "--cut", cut, "--hidden", "16", *SMALL,
                                 *CODECS.get((model, cut), []))
    assert ("net/train_fwd/sent_bytes" in metrics[-1]) == (cut != "input")
