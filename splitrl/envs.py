"""Environments for stage0: gymnasium's own wrappers, checked before any socket opens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from .settings import EnvSettings

__all__ = ["EnvSpec", "StepInTwo", "VECTOR_MODES", "make_single_env", "make_vector_env", "to_env_action", "inspect_env",
           "to_chw"]

VECTOR_MODES = ("sync", "async")


@dataclass(frozen=True)
class EnvSpec:
    """What the models need to know about an environment, channels first."""

    obs_shape: tuple[int, ...]
    """(C, H, W) after `to_chw`."""
    action_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]


def make_single_env(settings: EnvSettings) -> gym.Env:
    """One environment with the configured observation pipeline."""
    kwargs = {"max_episode_steps": settings.max_episode_steps} if settings.max_episode_steps else {}
    env = gym.make(settings.env_id, **kwargs)
    if settings.frame_skip > 1:
        env = gym.wrappers.MaxAndSkipObservation(env, skip=settings.frame_skip)
    if settings.grayscale:
        env = gym.wrappers.GrayscaleObservation(env, keep_dim=False)
    if settings.resize:
        env = gym.wrappers.ResizeObservation(env, (settings.resize, settings.resize))
    if settings.frame_stack > 1:
        env = gym.wrappers.FrameStackObservation(env, settings.frame_stack)
    return env


class StepInTwo(gym.vector.VectorWrapper):
    """The innermost wrapper: `begin` starts a step, the wrappers' `step` above it finishes it.

    With an `AsyncVectorEnv` the environments step in their worker processes between
    the two (gymnasium's ``step_async`` / ``step_wait``), so the caller can encode,
    send and receive meanwhile; with a `SyncVectorEnv` the step happens in `step`.
    gymnasium's own wrappers (episode statistics, reward normalisation) stay on top
    and see every step exactly as without this one.
    """

    def __init__(self, env: gym.vector.VectorEnv) -> None:
        super().__init__(env)
        self.pending: np.ndarray | None = None

    def begin(self, actions: np.ndarray) -> None:
        if self.pending is not None:
            raise RuntimeError("a step is already under way")
        if isinstance(self.env, gym.vector.AsyncVectorEnv):
            self.env.step_async(actions)
        self.pending = actions

    def step(self, actions: np.ndarray):
        if self.pending is None:  # a plain step
            self.begin(actions)
        pending, self.pending = self.pending, None
        if isinstance(self.env, gym.vector.AsyncVectorEnv):
            return self.env.step_wait()
        return self.env.step(pending)


def make_vector_env(settings: EnvSettings, *, vector: str = "sync", reward_gamma: float | None = None,
                    reward_clip: float = 0.0) -> tuple[gym.vector.VectorEnv, StepInTwo]:
    """``num_envs`` environments with episode statistics; returns (the envs, their `StepInTwo`).

    ``vector``: 'sync' steps them in this process (gymnasium's SyncVectorEnv), 'async'
    in one worker process each (AsyncVectorEnv, started with 'spawn': this process
    may already run threads, which 'fork' does not copy safely).

    Same-step autoreset: the step that ends an episode returns the next episode's
    first observation and puts the real last one in ``info["final_obs"]``, which
    is what bootstrapping a time-limit truncation needs.

    With ``reward_gamma`` the learner sees rewards scaled by gymnasium's
    NormalizeReward (then clipped to +-``reward_clip`` when > 0), as in CleanRL's
    continuous PPO; the episode statistics sit inside it, so they record the raw
    returns.
    """
    if vector not in VECTOR_MODES:
        raise ValueError(f"vector must be one of {', '.join(VECTOR_MODES)}, got {vector!r}")
    thunks: list[Callable[[], gym.Env]] = [lambda: make_single_env(settings)] * settings.num_envs
    if vector == "async":
        base: gym.vector.VectorEnv = gym.vector.AsyncVectorEnv(thunks, autoreset_mode=AutoresetMode.SAME_STEP,
                                                               context="spawn")
    else:
        base = gym.vector.SyncVectorEnv(thunks, autoreset_mode=AutoresetMode.SAME_STEP)
    stepper = StepInTwo(base)
    envs: gym.vector.VectorEnv = gym.wrappers.vector.RecordEpisodeStatistics(stepper)
    if reward_gamma is not None:
        envs = gym.wrappers.vector.NormalizeReward(envs, gamma=reward_gamma)
        if reward_clip > 0:
            envs = gym.wrappers.vector.ClipReward(envs, -reward_clip, reward_clip)
    return envs, stepper


def to_env_action(action: np.ndarray, low: np.ndarray, high: np.ndarray, mode: str) -> np.ndarray:
    """Policy actions in [-1, 1] (B, A) to the env's Box [low, high], float32.

    'affine' maps [-1, 1] onto [low, high], so the policy's initial mean lands mid-range:
    for CarRacing that is half gas *and half brake*. 'clip' scales by max(|low|, |high|)
    and clips, so 0 stays 0 (steering straight, no gas, no brake) and every action in the
    range, including its bounds, is reached by a finite pre-tanh action.
    """
    a = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
    if mode == "affine":
        out = low + (a + 1.0) * (high - low) / 2.0
    elif mode == "clip":
        out = np.clip(a * np.maximum(np.abs(low), np.abs(high)), low, high)
    else:
        raise ValueError(f"unknown action map {mode!r}")
    return out.astype(np.float32)


def to_chw(obs: np.ndarray, stacked: bool) -> np.ndarray:
    """Batch of observations (B, ...) to channels-first (B, C, H, W) uint8.

    Shapes after the wrappers: (B, H, W) grey; (B, H, W, 3) colour; with a frame
    stack (B, S, H, W) grey or (B, S, H, W, 3) colour, whose S and 3 become C.
    """
    if obs.ndim == 3:
        return obs[:, None]
    if obs.ndim == 4 and stacked:
        return obs
    if obs.ndim == 4:
        return np.moveaxis(obs, -1, 1)
    b, s, h, w, c = obs.shape
    return np.moveaxis(obs, -1, 2).reshape(b, s * c, h, w)


def inspect_env(settings: EnvSettings) -> EnvSpec:
    """Build one environment to check it is usable; raise ValueError saying why not."""
    try:
        env = make_single_env(settings)
    except gym.error.Error as exc:
        raise ValueError(f"--env-id {settings.env_id!r}: {exc}") from None
    except Exception as exc:  # wrappers reject unsuitable spaces with assorted errors
        raise ValueError(f"--env-id {settings.env_id!r} cannot be used with this observation pipeline: {exc}") from None
    try:
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    if not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) != 1:
        raise ValueError(f"--env-id {settings.env_id!r}: expected a 1-d Box action space, got {act_space}")
    if not (np.all(np.isfinite(act_space.low)) and np.all(np.isfinite(act_space.high))):
        raise ValueError(f"--env-id {settings.env_id!r}: the action space must be bounded, got {act_space}")
    if not isinstance(obs_space, gym.spaces.Box) or obs_space.dtype != np.uint8 or len(obs_space.shape) < 2:
        raise ValueError(
            f"--env-id {settings.env_id!r}: expected image observations (a uint8 Box of 2 or more dims), "
            f"got {obs_space}"
        )
    sample = np.zeros((1,) + obs_space.shape, dtype=np.uint8)
    chw = to_chw(sample, stacked=settings.frame_stack > 1).shape[1:]
    return EnvSpec(
        obs_shape=tuple(int(d) for d in chw),
        action_dim=int(act_space.shape[0]),
        action_low=tuple(float(x) for x in act_space.low),
        action_high=tuple(float(x) for x in act_space.high),
    )
