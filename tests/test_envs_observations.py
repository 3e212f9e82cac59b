"""The kinds of observations stage0 takes (splitrl/envs.py): what inspect_env learns of a state vector and of a
Dict, the rows they are stored and sent as, the image-only options, and the defaults that depend on the kind."""

import numpy as np
import pytest
import torch

from splitrl.envs import EnvSpec, inspect_env, make_vector_env, restore_vector_env, vector_env_state
from splitrl.models.layers import unpack_rows
from splitrl.settings import EnvSettings, SettingsError, TrainSettings

from .conftest import splitrl_here

PICK = "splitrl/PickByCue-v0"


def test_a_state_vector_is_a_float32_row():
    spec = inspect_env(EnvSettings(env_id="CartPole-v1"))
    assert spec == EnvSpec(obs_shape=(4,), action_dim=2, action_low=(0.0,), action_high=(1.0,), discrete=True,
                           observation="vector")
    assert spec.row_shape == (4,) and spec.row_dtype == "float32"
    rows = spec.rows(np.array([[1, 2, 3, 4]], dtype=np.float64), stacked=False)
    assert rows.dtype == np.float32 and rows.tolist() == [[1, 2, 3, 4]]


def test_a_dict_is_one_row_of_its_image_bytes_and_its_vector_values():
    spec = inspect_env(EnvSettings(env_id=PICK))
    assert (spec.observation, spec.obs_shape, spec.vector_dim, spec.keys) == ("dict", (3, 16, 16), 2, ("image", "cue"))
    assert spec.row_shape == (3 * 16 * 16 + 4 * 2,) and spec.row_dtype == "uint8"
    rng = np.random.default_rng(0)
    obs = {"image": rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8),
           "cue": rng.standard_normal((3, 2)).astype(np.float32)}
    rows = torch.as_tensor(spec.rows(obs, stacked=False))
    for batch in (rows, rows[1:2]):  # a batch of one is a view at the rows' start: no copy needed
        image, vector = unpack_rows(batch, spec.obs_shape, spec.vector_dim)
        picked = slice(0, 3) if len(batch) == 3 else slice(1, 2)
        assert torch.equal(image, torch.as_tensor(obs["image"][picked]).permute(0, 3, 1, 2))
        assert torch.equal(vector, torch.as_tensor(obs["cue"][picked]))
    with pytest.raises(ValueError, match=r"expected rows of 768 image bytes and 2 float32 values"):
        unpack_rows(rows[:, :-1], spec.obs_shape, spec.vector_dim)


@pytest.mark.parametrize("option, value, name", [("frame_stack", 4, "--frame-stack"), ("grayscale", True, "--grayscale"),
                                                 ("resize", 84, "--resize"), ("frame_skip", 2, "--frame-skip")])
@pytest.mark.parametrize("env_id, kind", [("CartPole-v1", "vector"), (PICK, "dict")])
def test_an_image_option_set_for_other_observations_is_one_line(env_id, kind, option, value, name):
    with pytest.raises(SettingsError) as info:
        inspect_env(EnvSettings(env_id=env_id, **{option: value}))
    message = str(info.value)
    assert message.startswith(f"--env-id {env_id!r} gives {kind} observations (") and "\n" not in message
    assert message.endswith(f"): {name} applies to images only")


def test_the_image_options_unset_or_off_do_not_apply_to_other_observations():
    off = EnvSettings(env_id="CartPole-v1", grayscale=False, frame_stack=1, resize=0, frame_skip=1)
    assert inspect_env(off) == inspect_env(EnvSettings(env_id="CartPole-v1"))
    assert EnvSettings().frame_stack is None and EnvSettings().grayscale is None
    assert EnvSettings().for_observation("vector") == EnvSettings(grayscale=False, frame_stack=1)


def test_the_image_defaults_and_the_model_are_what_they_were_for_images():
    assert inspect_env(EnvSettings()).obs_shape == (4, 96, 96)  # CarRacing: grey, 4 frames stacked
    image = TrainSettings().for_observation("image")
    assert (image.env.grayscale, image.env.frame_stack, image.model) == (True, 4, "nature")
    assert TrainSettings().for_observation("vector").model == "mlp"
    assert TrainSettings().for_observation("dict").model == "nature"
    assert TrainSettings(model="impala").for_observation("vector").model == "impala"  # a model given stays
    # A run's config written before these depended on the observations reads back as the same settings.
    old = TrainSettings().to_dict()
    old["model"], old["env"]["grayscale"], old["env"]["frame_stack"] = "nature", True, 4
    assert TrainSettings.from_dict(old).for_observation("image") == image


@pytest.mark.parametrize("args, words", [
    (["--frame-stack", "4"], "--frame-stack applies to images only"),
    (["--model", "nature"], "model 'nature' needs (C, H, W) image observations, got Box("),
    (["--model", "examples.my_encoder:small_cnn"], "model 'examples.my_encoder:small_cnn': its factory fails on the "
                                                   "observation space Box("),
])
def test_the_command_line_refuses_what_a_vector_env_cannot_take_in_one_line(tmp_path, args, words):
    result = splitrl_here("train", "--env-id", "CartPole-v1", *args, "--run-dir", str(tmp_path / "run"), code=2)
    problems = [line for line in result.output.splitlines() if line.startswith(("  - ", "error: "))]
    assert len(problems) == 1 and words in problems[0], result.output
    assert not (tmp_path / "run").exists()


def test_dict_envs_restored_from_a_snapshot_go_on_exactly_as_the_originals():
    settings = EnvSettings(env_id=PICK, num_envs=2)
    original, _ = make_vector_env(settings)
    copy_, _ = make_vector_env(settings)
    try:
        original.reset(seed=7)
        for _ in range(11):  # past the first episode's end at step 8
            obs, *_ = original.step(np.array([1, 2]))
        copy_.reset(seed=123)
        restored = restore_vector_env(copy_, vector_env_state(original))
        assert all(np.array_equal(restored[k], obs[k]) for k in obs)
        for _ in range(6):
            a, b = original.step(np.array([0, 3])), copy_.step(np.array([0, 3]))
            assert all(np.array_equal(a[0][k], b[0][k]) for k in a[0]) and np.array_equal(a[1], b[1])
    finally:
        original.close()
        copy_.close()
