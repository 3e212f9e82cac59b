"""`splitrl.carracing`: CarRacing's road pass for less CPU draws gymnasium's frames, bit for bit."""

import gymnasium as gym
import numpy as np
from gymnasium.envs.box2d.car_racing import CarRacing

from benchmarks.carracing_road import episode_frames
from splitrl import carracing
from splitrl.envs import make_single_env
from splitrl.settings import EnvSettings


def test_the_faster_road_draws_the_stock_frames_bit_for_bit():
    stock, rewards, _ = episode_frames(False, 160, 5, episode_steps=80)
    ours, _, _ = episode_frames(True, 160, 5, episode_steps=80)
    assert max(rewards) > 0  # tiles were driven over: the env repainted them
    assert len(stock) == len(ours) and len(stock) > 160  # a reset came between
    assert all(np.array_equal(a, b) for a, b in zip(stock, ours))


def test_what_a_person_sees_is_the_stock_frame_too():
    stock, _, _ = episode_frames(False, 12, 5, render_mode="rgb_array")
    ours, _, _ = episode_frames(True, 12, 5, render_mode="rgb_array")
    assert stock[-1].shape == (400, 600, 3) and all(np.array_equal(a, b) for a, b in zip(stock, ours))


def test_the_run_s_env_draws_the_faster_road():
    env = make_single_env(EnvSettings(env_id="CarRacing-v3"))
    assert "_render_road" in vars(env.unwrapped)
    env.close()


def test_it_stays_off_what_it_was_not_checked_against(monkeypatch):
    class OwnRoad(CarRacing):
        def _render_road(self, zoom, translation, angle):
            pass

    class OwnPolygons(CarRacing):
        def _draw_colored_polygon(self, *args, **kwargs):
            pass

    envs = [OwnRoad(), OwnPolygons(), gym.make("CartPole-v1")]
    assert not any(carracing.draw_road_faster(env) for env in envs)
    with monkeypatch.context() as patch:
        patch.setattr(gym, "__version__", "9.0.0")
        envs.append(gym.make("CarRacing-v3"))
        assert not carracing.draw_road_faster(envs[-1])
    with monkeypatch.context() as patch:
        patch.setattr("platform.machine", lambda: "aarch64")
        envs.append(gym.make("CarRacing-v3"))
        assert not carracing.draw_road_faster(envs[-1])
    envs.append(gym.make("CarRacing-v3"))
    assert carracing.draw_road_faster(envs[-1])  # the same env, where it was checked
    for env in envs:
        env.close()
