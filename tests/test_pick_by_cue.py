"""PickByCue (splitrl/pick_by_cue.py): deterministic given its seed, and a reward that needs both the image and
the cue."""

import gymnasium as gym
import numpy as np
import pytest

from splitrl import envs  # noqa: F401 - registers splitrl/PickByCue-v0
from splitrl.pick_by_cue import COLOURS, PickByCue


def _episode(env, seed, pick):
    obs, _ = env.reset(seed=seed)
    seen, total, done = [], 0.0, False
    while not done:
        seen.append(obs)
        obs, reward, done, truncated, _ = env.step(pick(obs))
        total += reward
        assert not truncated
    return seen, total


def _cell_of(image, colour):
    """The cell lit in ``colour`` (what a policy that reads the image and the cue does)."""
    row = image[image.shape[0] // 2]
    width = image.shape[1] // 4
    return next(c for c in range(4) if np.array_equal(row[c * width], COLOURS[colour]))


def test_the_same_seed_gives_the_same_scenes():
    a, b = _episode(PickByCue(), 3, lambda obs: 0), _episode(PickByCue(), 3, lambda obs: 0)
    assert a[1] == b[1] and len(a[0]) == 8
    for x, y in zip(a[0], b[0]):
        assert np.array_equal(x["image"], y["image"]) and np.array_equal(x["cue"], y["cue"])


def test_only_the_image_and_the_cue_together_score_every_pick():
    env = gym.make("splitrl/PickByCue-v0")
    assert env.observation_space["image"].shape == (16, 16, 3) and env.observation_space["cue"].shape == (2,)
    both = [_episode(env, s, lambda obs: _cell_of(obs["image"], int(obs["cue"].argmax())))[1] for s in range(20)]
    image_only = [_episode(env, s, lambda obs: _cell_of(obs["image"], 0))[1] for s in range(20)]  # always red
    cue_only = [_episode(env, s, lambda obs: int(obs["cue"].argmax()))[1] for s in range(20)]  # a cell per colour
    assert both == [8.0] * 20
    assert 2.0 < np.mean(image_only) < 6.0 and 0.5 < np.mean(cue_only) < 3.5  # 4 and 2 expected


def test_a_pick_outside_the_cells_is_refused():
    env = PickByCue()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="not in Discrete"):
        env.step(4)
