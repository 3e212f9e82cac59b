"""`splitrl.carracing`: CarRacing's road pass and score font for less CPU draw gymnasium's frames, bit for bit."""

import threading

import gymnasium as gym
import numpy as np
import pygame
from gymnasium.envs.box2d.car_racing import CarRacing

from benchmarks.carracing_road import episode_frames
from splitrl import carracing
from splitrl.envs import make_single_env
from splitrl.settings import EnvSettings


def test_the_faster_road_draws_the_stock_frames_bit_for_bit():
    stock, rewards, _ = episode_frames(False, 160, 5, episode_steps=80)
    ours, _, _ = episode_frames(True, 160, 5, episode_steps=80)
    assert max(rewards) > 0  # tiles were driven over: the env repainted them (and the score changed)
    assert len(stock) == len(ours) and len(stock) > 160  # a reset came between
    assert all(np.array_equal(a, b) for a, b in zip(stock, ours))
    road_alone, _, _ = episode_frames(True, 160, 5, episode_steps=80, font=False)
    assert all(np.array_equal(a, b) for a, b in zip(stock, road_alone))


def test_the_score_s_font_is_opened_once_a_thread_and_again_after_pygame_shut_it(monkeypatch):
    opened = []
    stock_font = pygame.font.Font
    monkeypatch.setattr(pygame.font, "Font", lambda *args: opened.append(args) or stock_font(*args))
    frames, stock_frames = [], []

    def drive(faster: bool, out: list) -> None:  # in a thread of its own: no font kept there yet
        env = gym.make("CarRacing-v3")
        assert not faster or carracing.draw_faster(env)
        env.reset(seed=3)
        for step in range(6):
            if step == 3:
                pygame.font.quit()  # what pygame.quit() does; the env's next frame starts it again
            out.append(env.step(np.array([0.0, 1.0, 0.0], dtype=np.float32))[0])
        env.close()

    counts = []
    for faster, out in ((True, frames), (False, stock_frames)):
        thread = threading.Thread(target=drive, args=(faster, out))
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive()
        counts.append(len(opened) - sum(counts))
    assert counts == [2, 7]  # ours: once, and once more after the shutdown; the stock env: at every frame
    assert len(set(opened)) == 1 and len(frames) == 6
    assert all(np.array_equal(a, b) for a, b in zip(frames, stock_frames))


def test_what_a_person_sees_is_the_stock_frame_too():
    stock, _, _ = episode_frames(False, 12, 5, render_mode="rgb_array")
    ours, _, _ = episode_frames(True, 12, 5, render_mode="rgb_array")
    assert stock[-1].shape == (400, 600, 3) and all(np.array_equal(a, b) for a, b in zip(stock, ours))


def test_the_run_s_env_draws_the_faster_road_with_the_kept_font():
    env = make_single_env(EnvSettings(env_id="CarRacing-v3"))
    assert {"_render_road", "_render"} <= set(vars(env.unwrapped))
    env.close()


def test_it_stays_off_what_it_was_not_checked_against(monkeypatch):
    class OwnRoad(CarRacing):
        def _render_road(self, zoom, translation, angle):
            pass

    class OwnPolygons(CarRacing):
        def _draw_colored_polygon(self, *args, **kwargs):
            pass

    class OwnRender(CarRacing):
        def _render(self, mode):
            pass

    def given(env) -> set[str]:
        return {name for name in ("_render_road", "_render") if name in vars(env.unwrapped)}

    envs = [OwnRoad(), OwnPolygons(), OwnRender(), gym.make("CartPole-v1")]
    assert carracing.draw_faster(envs[0]) and given(envs[0]) == {"_render"}  # its own road, the kept font
    assert carracing.draw_faster(envs[1]) and given(envs[1]) == {"_render"}
    assert carracing.draw_faster(envs[2]) and given(envs[2]) == {"_render_road"}
    assert not carracing.draw_faster(envs[3])
    with monkeypatch.context() as patch:
        patch.setattr(gym, "__version__", "9.0.0")
        envs.append(gym.make("CarRacing-v3"))
        assert not carracing.draw_faster(envs[-1]) and not given(envs[-1])
    with monkeypatch.context() as patch:
        patch.setattr("platform.machine", lambda: "aarch64")  # the road's rounding was checked on x86-64 only
        envs.append(gym.make("CarRacing-v3"))
        assert carracing.draw_faster(envs[-1]) and given(envs[-1]) == {"_render"}
    with monkeypatch.context() as patch:
        patch.setattr(pygame, "IS_CE", False, raising=False)  # the stale-font check is pygame-ce's
        carracing._render_with_kept_fonts.cache_clear()
        envs.append(gym.make("CarRacing-v3"))
        assert carracing.draw_faster(envs[-1]) and given(envs[-1]) == {"_render_road"}
    carracing._render_with_kept_fonts.cache_clear()
    envs.append(gym.make("CarRacing-v3"))
    assert carracing.draw_faster(envs[-1]) and given(envs[-1]) == {"_render_road", "_render"}  # where checked
    for env in envs:
        env.close()
