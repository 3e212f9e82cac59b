"""Discrete action spaces on stage0's side: what inspect_env learns, what the env is given, what is refused."""

import dataclasses

import gymnasium as gym
import numpy as np
import pytest

from splitrl import envs as envs_module
from splitrl.envs import EnvSpec, inspect_env, make_single_env
from splitrl.settings import EnvSettings, SettingsError

from .dots import DOTS_ENV_ID, DotsEnv


def test_inspect_env_learns_a_discrete_space():
    spec = inspect_env(EnvSettings(env_id=DOTS_ENV_ID))
    assert spec == EnvSpec(obs_shape=(4, 48, 48), action_dim=3, action_low=(0.0,), action_high=(2.0,), discrete=True)
    assert spec.env_action(np.array([2, 0, 1]), "clip").tolist() == [2, 0, 1]


def test_a_discrete_space_that_starts_elsewhere_gets_its_own_actions():
    spec = inspect_env(EnvSettings(env_id=DOTS_ENV_ID, env_kwargs="start=-1"))
    assert (spec.action_dim, spec.action_low, spec.action_high) == (3, (-1.0,), (1.0,))
    actions = spec.env_action(np.array([0, 1, 2]), "clip")
    assert actions.dtype == np.int64 and actions.tolist() == [-1, 0, 1]
    env = make_single_env(EnvSettings(env_id=DOTS_ENV_ID, env_kwargs="start=-1"))
    env.reset(seed=0)
    for a in actions:
        env.step(a)  # DotsEnv refuses anything outside its space
    env.close()


def test_a_box_spec_still_maps_through_the_action_map():
    spec = EnvSpec(obs_shape=(4, 96, 96), action_dim=3, action_low=(-1.0, 0.0, 0.0), action_high=(1.0, 1.0, 1.0))
    assert not spec.discrete
    out = spec.env_action(np.array([[0.5, -0.5, 1.0]]), "clip")
    assert out.dtype == np.float32 and out.tolist() == [[0.5, 0.0, 1.0]]


def test_an_old_run_config_without_the_discrete_field_still_loads():
    saved = dataclasses.asdict(EnvSpec(obs_shape=(4, 96, 96), action_dim=3, action_low=(-1.0, 0.0, 0.0),
                                       action_high=(1.0, 1.0, 1.0)))
    del saved["discrete"]
    assert not EnvSpec(**saved).discrete


@pytest.mark.parametrize("space, words", [
    (gym.spaces.MultiDiscrete([3, 3]), "expected a Discrete or a 1-d Box action space, got MultiDiscrete"),
    (gym.spaces.Box(-1, 1, (2, 2)), "expected a Discrete or a 1-d Box action space, got Box"),
    (gym.spaces.Discrete(1), "a Discrete action space needs 2 or more actions"),
    (gym.spaces.Box(-np.inf, np.inf, (2,)), "the action space must be bounded"),
])
def test_other_action_spaces_are_refused_saying_what_was_found(monkeypatch, space, words):
    def make(settings, render_mode=None):
        env = DotsEnv()
        env.action_space = space
        return env

    monkeypatch.setattr(envs_module, "make_single_env", make)
    with pytest.raises(SettingsError, match="--env-id") as info:
        inspect_env(EnvSettings(env_id=DOTS_ENV_ID))
    assert words in str(info.value)


def test_a_discrete_episode_can_be_replayed_from_its_snapshot():
    settings = EnvSettings(env_id=DOTS_ENV_ID, max_episode_steps=50)
    env, other = make_single_env(settings), make_single_env(settings)
    env.reset(seed=11)
    away = 0 if env.unwrapped.target > env.unwrapped.agent else 2  # never onto the target: the episode goes on
    for a in (away, 1, away):
        obs, _, terminated, _, _ = env.step(np.int64(a))
        assert not terminated
    assert np.array_equal(other.restore(env.snapshot()), obs)
    env.close()
    other.close()


def test_the_test_env_is_deterministic_given_its_seed():
    a, b = DotsEnv(), DotsEnv()
    assert np.array_equal(a.reset(seed=5)[0], b.reset(seed=5)[0])
    for action in (0, 2, 2, 1):
        assert np.array_equal(a.step(action)[0], b.step(action)[0])
    with pytest.raises(ValueError, match="not in Discrete"):
        a.step(3)
