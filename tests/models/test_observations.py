"""Networks for observations beyond stacked frames: an mlp on state vectors, a Dict's image through the model
with its vector joined to the features (at the model's end, or where its factory says), and the one-line refusal
of a model that cannot take the observation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from splitrl.envs import EnvSpec
from splitrl.models import Network, ScaleObs, agent, build_agent
from splitrl.settings import SettingsError, TrainSettings

IMAGE = (3, 16, 16)
SMALL = {"width": 4, "blocks": 0, "features": 16}
VECTOR_SPEC = EnvSpec(obs_shape=(6,), action_dim=2, action_low=(0.0,), action_high=(1.0,), discrete=True,
                      observation="vector")
DICT_SPEC = EnvSpec(obs_shape=IMAGE, action_dim=4, action_low=(0.0,), action_high=(3.0,), discrete=True,
                    observation="dict", vector_dim=2, keys=("image", "cue"))


def _rows(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows as stage0 stores them, the images (B, C, H, W), the vectors) of a random Dict batch. The images are
    contiguous, as the encoder reads them from the rows: a convolution picks its kernel by the input's memory layout,
    and on some CPUs (AVX2 without AVX-512, seen here) a channels-last view's last bits differ."""
    rng = np.random.default_rng(seed)
    obs = {"image": rng.integers(0, 256, (batch, 16, 16, 3), dtype=np.uint8),
           "cue": rng.standard_normal((batch, 2)).astype(np.float32)}
    rows = torch.as_tensor(DICT_SPEC.rows(obs, stacked=False))
    return rows, torch.as_tensor(obs["image"]).permute(0, 3, 1, 2).contiguous(), torch.as_tensor(obs["cue"])


def test_auto_is_an_mlp_on_state_vectors_and_the_papers_network_on_images():
    encoder, heads = agent(TrainSettings(hidden=16), VECTOR_SPEC)
    assert isinstance(encoder[0][0], nn.Linear) and encoder[0][0].in_features == 6
    assert encoder(torch.randn(3, 6)).shape == (3, 64) and heads.input_dim == 64
    mlp, _ = agent(TrainSettings(hidden=16, model="mlp"), VECTOR_SPEC)
    assert all(torch.equal(p, q) for p, q in zip(encoder.parameters(), mlp.parameters()))
    image_spec = EnvSpec(obs_shape=(4, 84, 84), action_dim=3, action_low=(-1.0,) * 3, action_high=(1.0,) * 3)
    auto, _ = agent(TrainSettings(), image_spec)
    nature, _ = agent(TrainSettings(model="nature"), image_spec)
    assert all(torch.equal(p, q) for p, q in zip(auto.parameters(), nature.parameters()))


def test_a_dicts_vector_is_joined_to_the_image_features_after_the_model():
    encoder, heads = build_agent(IMAGE, 4, "cnn", seed=1, model="impala", model_kwargs=SMALL, discrete=True,
                                 observation="dict", vector_dim=2, hidden=8)
    plain, _ = build_agent(IMAGE, 4, "cnn", seed=1, model="impala", model_kwargs=SMALL, discrete=True, hidden=8)
    rows, images, vectors = _rows(3)
    features = encoder(rows)
    assert features.shape == (3, 16 + 2) and heads.input_dim == 18
    torch.testing.assert_close(features[:, :16], plain(images), rtol=0, atol=0)  # the same weights, the image's
    assert torch.equal(features[:, 16:], vectors)  # the vector as it is
    whole, heads = build_agent(IMAGE, 4, "input", seed=1, model="impala", model_kwargs=SMALL, discrete=True,
                               observation="dict", vector_dim=2, hidden=8)
    assert len(whole) == 0  # the rows cross, stage1 unpacks them
    torch.testing.assert_close(heads.trunk(rows), features, rtol=0, atol=0)


def test_a_cut_before_the_join_is_refused_in_one_line():
    with pytest.raises(SettingsError) as info:
        build_agent(IMAGE, 4, "stack1", seed=1, model="impala", model_kwargs=SMALL, discrete=True,
                    observation="dict", vector_dim=2)
    assert str(info.value) == ("cut 'stack1' of model 'impala' lies before the Dict observation's vector joins the "
                               "image's features (after layer 'fc'); cut at 'input', at the join or after it")


def joined_early(observation_space, action_space, width: int = 8):
    """The vector joins the flat output of a conv; the layer after the join takes both."""
    c, h, w = observation_space["image"].shape
    d = observation_space["vector"].shape[0]
    return Network((("scale", ScaleObs()), ("conv", nn.Conv2d(c, 2, 4, stride=4)), ("flatten", nn.Flatten()),
                    ("fc", nn.Sequential(nn.Linear(2 * (h // 4) * (w // 4) + d, width), nn.ReLU()))), join="flatten")


@pytest.mark.parametrize("cut, width", [("flatten", 2 * 4 * 4 + 2), ("fc", 8), ("cnn", 8)])
def test_a_factory_may_say_which_layer_the_vector_joins_after(cut, width):
    encoder, heads = build_agent(IMAGE, 4, cut, seed=1, model="tests.models.test_observations:joined_early",
                                 discrete=True, observation="dict", vector_dim=2)
    rows, images, vectors = _rows(2)
    assert encoder(rows).shape == (2, width)
    if cut == "flatten":
        conv = encoder[1].layer
        assert torch.equal(encoder(rows), torch.cat([conv(images.float() / 255).flatten(1), vectors], dim=1))
        assert isinstance(heads.trunk[0][0], nn.Linear)  # the layer after the join is as the factory made it
    with pytest.raises(SettingsError, match=r"^cut 'scale' of model .* lies before the Dict observation's vector"):
        build_agent(IMAGE, 4, "scale", seed=1, model="tests.models.test_observations:joined_early", discrete=True,
                    observation="dict", vector_dim=2)


def test_a_join_without_a_vector_is_refused():
    with pytest.raises(SettingsError) as info:
        build_agent(IMAGE, 4, "cnn", seed=1, model="tests.models.test_observations:joined_early")
    assert str(info.value).startswith("model 'tests.models.test_observations:joined_early': its factory fails on the "
                                      "observation space Box(0, 255, (3, 16, 16), uint8)")  # it reads a Dict's parts
    with pytest.raises(SettingsError, match=r"^model '.*:joins_on_vectors' joins a vector after layer 'fc', but the "
                                            r"observations are vectors: only a Dict observation has a vector to join$"):
        build_agent((6,), 2, "cnn", seed=1, model="tests.models.test_observations:joins_on_vectors",
                    observation="vector")


def joins_on_vectors(observation_space, action_space):
    return Network((("fc", nn.Linear(observation_space.shape[0], 4)),), join="fc")


@pytest.mark.parametrize("model, observation, words", [
    ("nature", "vector", "model 'nature' needs (C, H, W) image observations, got Box(-inf, inf, (6,), float32)"),
    ("mlp", "dict", "model 'mlp' needs a 1-d Box observation (a state vector), got Dict("),
    ("examples.my_encoder:small_cnn", "vector", "model 'examples.my_encoder:small_cnn': its factory fails on the "
                                                "observation space Box(-inf, inf, (6,), float32): ValueError: "),
    ("examples.my_encoder:small_cnn", "dict", "model 'examples.my_encoder:small_cnn': its factory fails on the "
                                              "observation space Dict("),
])
def test_a_model_that_cannot_take_the_observation_is_one_line(model, observation, words):
    spec = VECTOR_SPEC if observation == "vector" else DICT_SPEC
    with pytest.raises(SettingsError) as info:
        agent(TrainSettings(model=model), spec)
    assert str(info.value).startswith(words) and "\n" not in str(info.value)
