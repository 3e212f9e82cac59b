"""The env side of stage0: action maps and the reward pipeline."""

import os
import signal
import time

import numpy as np
import pytest

from splitrl.envs import make_vector_env, to_env_action
from splitrl.models import build_agent
from splitrl.settings import EnvSettings, TrainSettings

CAR_LOW = np.array([-1.0, 0.0, 0.0])
CAR_HIGH = np.array([1.0, 1.0, 1.0])


def test_clip_map_keeps_zero_at_zero_and_reaches_every_bound():
    a = np.array([[0.0, 0.0, 0.0], [-1.0, -0.3, 1.0], [1.0, 0.4, -1.0]])
    out = to_env_action(a, CAR_LOW, CAR_HIGH, "clip")
    np.testing.assert_allclose(out, [[0, 0, 0], [-1, 0, 1], [1, 0.4, 0]], atol=1e-7)
    assert out.dtype == np.float32


def test_clip_map_scales_by_the_largest_bound():
    out = to_env_action(np.array([[0.5, -0.5, 1.0]]), np.array([-2.0, 0.0, -1.0]), np.array([2.0, 5.0, 3.0]), "clip")
    np.testing.assert_allclose(out, [[1.0, 0.0, 3.0]])


def test_affine_map_spans_the_box_and_centres_at_mid_range():
    a = np.array([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    np.testing.assert_allclose(to_env_action(a, CAR_LOW, CAR_HIGH, "affine"), [[-1, 0, 0], [0, 0.5, 0.5], [1, 1, 1]])


@pytest.mark.parametrize("mode", ["clip", "affine"])
def test_out_of_range_policy_actions_stay_inside_the_box(mode):
    rng = np.random.default_rng(0)
    out = to_env_action(rng.normal(0, 3, size=(1000, 3)), CAR_LOW, CAR_HIGH, mode)
    assert np.all(out >= CAR_LOW) and np.all(out <= CAR_HIGH)


def test_unknown_action_map_is_refused():
    with pytest.raises(ValueError, match="action map"):
        to_env_action(np.zeros((1, 3)), CAR_LOW, CAR_HIGH, "bogus")
    assert any("--action-map" in e for e in TrainSettings(env=EnvSettings(action_map="bogus")).errors())


def test_normalised_rewards_reach_the_learner_while_episodes_record_raw_returns():
    settings = EnvSettings(env_id="CarRacing-v3", max_episode_steps=30)
    (raw, _), (scaled, _) = make_vector_env(settings), make_vector_env(settings, reward_gamma=0.99, reward_clip=0.5)
    raw.reset(seed=3)
    scaled.reset(seed=3)
    action = np.array([[0.0, 0.5, 0.0]], dtype=np.float32)
    raw_rewards, scaled_rewards, episode = [], [], None
    for _ in range(30):
        _, r_raw, *_ = raw.step(action)
        _, r_scaled, _, _, info = scaled.step(action)
        raw_rewards.append(float(r_raw[0]))
        scaled_rewards.append(float(r_scaled[0]))
        if info.get("_episode", [False])[0]:
            episode = float(info["episode"]["r"][0])
    raw.close()
    scaled.close()
    assert episode == pytest.approx(sum(raw_rewards), rel=1e-5)  # the statistics saw raw rewards
    assert max(abs(r) for r in scaled_rewards) <= 0.5  # the learner saw scaled, clipped ones
    assert scaled_rewards != pytest.approx(raw_rewards)


def test_initial_log_std_is_a_setting():
    _, heads = build_agent((4, 96, 96), 3, "cnn", seed=0, init_log_std=-0.5)
    assert heads.actor_logstd.detach().tolist() == [-0.5] * 3


def test_async_envs_stepped_in_two_halves_give_what_sync_envs_give():
    settings = EnvSettings(num_envs=2, max_episode_steps=12)
    seen = {}
    for mode in ("sync", "async"):
        envs, stepper = make_vector_env(settings, vector=mode, reward_gamma=0.99, reward_clip=10.0)
        obs, _ = envs.reset(seed=5)
        trace = [obs.copy()]
        rng = np.random.default_rng(0)
        try:
            for _ in range(15):  # through a time-limit reset: final_obs and episode statistics
                action = rng.uniform(-1, 1, (2, 3)).astype(np.float32)
                stepper.begin(action)
                obs, reward, terminated, truncated, info = envs.step(action)
                trace += [obs.copy(), reward.copy(), terminated.copy(), truncated.copy()]
                if truncated.any():
                    trace += [np.stack([info["final_obs"][i] for i in np.flatnonzero(truncated)]),
                              info["episode"]["r"].copy()]
        finally:
            envs.close()
        seen[mode] = trace
    assert len(seen["sync"]) == len(seen["async"]) > 60
    for a, b in zip(seen["sync"], seen["async"]):
        assert np.array_equal(a, b)


def test_async_env_workers_leave_ctrl_c_to_their_parent():
    """Ctrl-C reaches the whole process group; the workers ignore it (their parent stops them) instead of each
    dying with a traceback about the pipe their parent is closing."""
    envs, stepper = make_vector_env(EnvSettings(num_envs=2, max_episode_steps=12), vector="async")
    try:
        envs.reset(seed=5)
        for process in stepper.env.processes:
            os.kill(process.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(process.is_alive() for process in stepper.env.processes)
        action = np.zeros((2, 3), dtype=np.float32)
        for _ in range(3):
            stepper.begin(action)
            envs.step(action)
    finally:
        envs.close()


@pytest.mark.parametrize("nice", [0, 3, 40])
def test_async_env_workers_run_as_much_nicer_than_their_parent_as_asked(nice):
    envs, stepper = make_vector_env(EnvSettings(num_envs=2, max_episode_steps=12), vector="async", nice=nice)
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, p.pid) for p in stepper.env.processes] == [min(19, own + nice)] * 2
        envs.reset(seed=5)  # and they step
    finally:
        envs.close()


def test_a_run_starts_its_edge_env_workers_at_its_env_nice():
    from splitrl.envs import inspect_env
    from splitrl.runner.build import make_edge
    from splitrl.settings import RunOptions

    assert RunOptions().env_nice == 10  # Sample Factory's +10 for its rollout workers
    settings = TrainSettings(env=EnvSettings(num_envs=2, max_episode_steps=12))
    edge = make_edge(settings, inspect_env(settings.env), None, RunOptions(vector="async", env_nice=4))
    edge.open_envs()
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        pids = [p.pid for stepper in edge.envs.steppers for p in stepper.env.processes]
        assert len(pids) == 2 and {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {min(19, own + 4)}
    finally:
        edge.envs.close()


@pytest.mark.parametrize("vector", ["sync", "async"])
def test_envs_restored_from_a_snapshot_go_on_exactly_as_the_originals(vector):
    """Snapshot mid-episode (one env across a time-limit reset), restore into fresh envs, step both alike:
    observations, rewards (normalised), flags and episode statistics agree bit for bit."""
    from splitrl.envs import restore_vector_env, vector_env_state

    settings = EnvSettings(num_envs=2, max_episode_steps=12)
    rng = np.random.default_rng(1)
    actions = rng.uniform(-1, 1, (40, 2, 3)).astype(np.float32)
    original, _ = make_vector_env(settings, vector=vector, reward_gamma=0.99, reward_clip=10.0)
    copy_, _ = make_vector_env(settings, vector=vector, reward_gamma=0.99, reward_clip=10.0)
    try:
        original.reset(seed=7)
        for a in actions[:17]:  # past the first reset at step 12
            obs, *_ = original.step(a)
        state = vector_env_state(original)
        copy_.reset(seed=123)  # any seed: the restore replaces it
        restored = restore_vector_env(copy_, state)
        assert np.array_equal(restored, obs)
        for a in actions[17:]:
            a_out, b_out = original.step(a), copy_.step(a)
            for x, y in zip(a_out[:4], b_out[:4]):
                assert np.array_equal(x, y)
            if "episode" in a_out[4]:
                assert np.array_equal(a_out[4]["episode"]["r"], b_out[4]["episode"]["r"])
    finally:
        original.close()
        copy_.close()


def test_vector_auto_steps_envs_in_workers_from_four_envs_on():
    from splitrl.envs import ASYNC_FROM_ENVS, choose_vector

    assert ASYNC_FROM_ENVS == 4  # where docs/benchmarks/vector.md measured AsyncVectorEnv faster
    assert [choose_vector("auto", n) for n in (1, 2, 3, 4, 8)] == ["sync"] * 3 + ["async"] * 2
    assert choose_vector("sync", 8) == "sync" and choose_vector("async", 1) == "async"
    with pytest.raises(ValueError, match="vector must be one of auto, sync, async"):
        choose_vector("threads", 4)
