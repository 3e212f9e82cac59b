"""Environments for stage0: gymnasium's own wrappers, checked before any socket opens; the kinds of observations
(images, state vectors, a Dict of an image and vectors) and the rows stage0 stores and sends them as."""

from __future__ import annotations

import copy
import os
from collections import deque
import signal
from dataclasses import dataclass
from typing import Any, Callable

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from . import stops
from .allocator import keep_freed_memory
from .carracing import draw_faster
from .grayscale import faster_grayscale
from .settings import VECTOR_MODES, EnvSettings, SettingsError

__all__ = ["EnvSpec", "Replayable", "StepInTwo", "VECTOR_MODES", "choose_vector", "make_single_env", "make_vector_env", "to_env_action",
           "inspect_env", "to_chw", "vector_env_state", "restore_vector_env", "IMAGE", "VECTOR", "DICT",
           "observation_kind", "batch"]

IMAGE, VECTOR, DICT = "image", "vector", "dict"
"""The kinds of observations splitrl takes (`observation_kind`): stacked frames, a state vector, or a Dict of an
image and vectors (a camera and proprioception)."""


@dataclass(frozen=True)
class EnvSpec:
    """What the models need to know about an environment, channels first."""

    obs_shape: tuple[int, ...]
    """Images: (C, H, W) after `to_chw`; vectors: (D,); a Dict: its image's (C, H, W)."""
    action_dim: int
    """The actor's outputs: a Box's dimensions, or a Discrete space's number of actions."""
    action_low: tuple[float, ...]
    """A Box's lower bounds; for a Discrete space (its first action,)."""
    action_high: tuple[float, ...]
    """A Box's upper bounds; for a Discrete space (its last action,)."""
    discrete: bool = False
    """Whether the action space is Discrete (a categorical policy). Defaults to False because run configs under
    docs/results have no such key and are Box runs."""
    observation: str = IMAGE
    """`IMAGE`, `VECTOR` or `DICT` (`observation_kind`); run configs written before vectors had no such key."""
    vector_dim: int = 0
    """A Dict's vectors' length, joined."""
    keys: tuple[str, ...] = ()
    """A Dict's keys: its image's, then its vectors' in the order they are joined (the Dict's own)."""

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One observation as stage0 stores it and sends it at the cut before the first layer (`rows`): an image
        (C, H, W), a vector (D,), a Dict one row of C * H * W + 4 * D bytes."""
        if self.observation == DICT:
            return (int(np.prod(self.obs_shape)) + 4 * self.vector_dim,)
        return self.obs_shape

    @property
    def row_dtype(self) -> str:
        """The dtype of `rows`, as numpy and torch name it: float32 for vectors, uint8 for the others."""
        return "float32" if self.observation == VECTOR else "uint8"

    def rows(self, obs: Any, stacked: bool) -> np.ndarray:
        """A batch of the envs' observations (B, ...) as rows of `row_shape`: images channels first (`to_chw`;
        ``stacked``: a frame stack's), vectors as float32, and a Dict's image bytes followed by its vectors'
        float32 values, joined, as bytes in the machine's order (the wire's, which is little-endian on every
        machine splitrl runs on): `splitrl.models.layers.unpack_rows` reads them back."""
        if self.observation == IMAGE:
            return to_chw(obs, stacked)
        if self.observation == VECTOR:
            return np.asarray(obs, dtype=np.float32)
        image = to_chw(np.asarray(obs[self.keys[0]]), stacked=False)
        b = len(image)
        vector = np.concatenate([np.asarray(obs[k], dtype=np.float32).reshape(b, -1) for k in self.keys[1:]], axis=1)
        return np.concatenate([image.reshape(b, -1), np.ascontiguousarray(vector).view(np.uint8)], axis=1)

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> "EnvSpec":
        """The spec a run's config wrote (its ``env_spec``: JSON lists back to tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def env_action(self, action: np.ndarray, mode: str) -> np.ndarray:
        """What the envs are given for the actions stage1 sent (`ActorCriticHeads.wire_action`): a Discrete
        space's int64 actions from indices 0 .. action_dim - 1 (B,), shifted by its start; a Box's float32
        actions from [-1, 1] (B, A), mapped by `to_env_action` as ``mode`` says."""
        if self.discrete:
            return np.asarray(action, dtype=np.int64) + int(self.action_low[0])
        return to_env_action(action, np.asarray(self.action_low), np.asarray(self.action_high), mode)


class Replayable(gym.Wrapper):
    """Keeps what rebuilds this env exactly: how its episode began and the actions since.

    An env's own state (CarRacing's Box2D world) cannot be saved, but its dynamics are
    deterministic: an env reset from the same seed, or from the same state of its random
    generator, and given the same actions, passes through the same states, frame stack
    and time limit included. `snapshot` is that recipe; `restore` follows it (at most one
    episode of steps) and returns the observation it ends at.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.start: dict[str, Any] = {}
        self.actions: list[np.ndarray] = []
        self.pending: dict[str, Any] | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        # The generator as the reset found it: an episode begun without a seed draws its track from it.
        state = None if seed is not None else copy.deepcopy(self.unwrapped.np_random.bit_generator.state)
        self.start, self.actions = {"seed": seed, "rng": state}, []
        with stops.kept():  # CarRacing draws with pygame, which can drop a Ctrl-C (`splitrl.stops`)
            return super().reset(seed=seed, options=options)

    def step(self, action):
        self.actions.append(np.array(action, copy=True))
        with stops.kept():
            return super().step(action)

    def snapshot(self) -> dict[str, Any]:
        actions = np.stack(self.actions) if self.actions else np.zeros((0,) + self.action_space.shape, np.float32)
        return {**self.start, "actions": actions}

    def restore(self, snapshot: dict[str, Any] | None = None) -> Any:
        """Rebuild the state ``snapshot`` (default: the one `pending` holds) describes; its observation."""
        snapshot = snapshot if snapshot is not None else self.pending
        self.pending = None
        if snapshot["seed"] is None:
            self.unwrapped.np_random.bit_generator.state = snapshot["rng"]
        obs, _ = self.reset(seed=snapshot["seed"])
        if snapshot["seed"] is None:  # reset() recorded the generator after we set it: the same state
            self.start["rng"] = snapshot["rng"]
        for action in snapshot["actions"]:
            obs, _, terminated, truncated, _ = self.step(action)
            if terminated or truncated:
                raise ValueError("an env snapshot's actions end its episode before the last: it cannot be replayed")
        return obs


def _is_image(space: Any) -> bool:
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) >= 2


def _is_vector(space: Any) -> bool:
    return isinstance(space, gym.spaces.Box) and len(space.shape) == 1


def observation_kind(space: Any) -> str | None:
    """`IMAGE` (a uint8 Box of 2 or more dims), `VECTOR` (a 1-d Box), `DICT` (a Dict of one image of 2 or 3 dims,
    (H, W) or (H, W, C), and one or more 1-d Boxes), or None: none that splitrl takes."""
    if _is_image(space):
        return IMAGE
    if _is_vector(space):
        return VECTOR
    if isinstance(space, gym.spaces.Dict):
        parts = list(space.spaces.values())
        images = [s for s in parts if _is_image(s) and len(s.shape) <= 3]
        if len(images) == 1 and all(s in images or _is_vector(s) for s in parts) and len(parts) > 1:
            return DICT
    return None


def make_single_env(settings: EnvSettings, render_mode: str | None = None) -> gym.Env:
    """One environment with the configured observation pipeline (``render_mode``: gymnasium's, e.g.
    ``"rgb_array"`` for recording what a person would see). The image options apply to image observations;
    set for others, they are a SettingsError."""
    kwargs: dict[str, Any] = {"max_episode_steps": settings.max_episode_steps} if settings.max_episode_steps else {}
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    env = gym.make(settings.env_id, **settings.kwargs(), **kwargs)
    draw_faster(env)  # CarRacing: the same frames for less CPU
    kind = observation_kind(env.observation_space)
    if kind != IMAGE:
        asked = settings.image_options()
        if kind is not None and asked:
            env.close()
            raise SettingsError(f"--env-id {settings.env_id!r} gives {kind} observations ({env.observation_space}): "
                                f"{', '.join(asked)} {'applies' if len(asked) == 1 else 'apply'} to images only")
        return Replayable(env)
    grayscale, frame_stack = settings.image_pipeline
    if settings.frame_skip > 1:
        env = gym.wrappers.MaxAndSkipObservation(env, skip=settings.frame_skip)
    if grayscale:
        env = gym.wrappers.GrayscaleObservation(env, keep_dim=False)
        faster_grayscale(env)  # the same bytes for less CPU
    if settings.resize:
        env = gym.wrappers.ResizeObservation(env, (settings.resize, settings.resize))
    if frame_stack > 1:
        env = gym.wrappers.FrameStackObservation(env, frame_stack)
    return Replayable(env)


def batch(observations: list[Any]) -> Any:
    """Single observations (arrays, or a Dict's dicts of arrays) as one batch, as a vector env gives them."""
    if observations and isinstance(observations[0], dict):
        return {key: np.stack([obs[key] for obs in observations]) for key in observations[0]}
    return np.stack(observations)


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


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
"""/proc/PID/stat's unit of CPU time, per second."""


def worker_cpu_seconds(stepper: StepInTwo) -> float | None:
    """CPU seconds (user + system) the worker processes of ``stepper``'s envs have used so far: 0 when the envs
    step in this process (their time is its own), None on a system without Linux's /proc."""
    if not isinstance(stepper.env, gym.vector.AsyncVectorEnv):
        return 0.0
    total = 0.0
    for process in stepper.env.processes:
        try:
            with open(f"/proc/{process.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold spaces
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat(5)
    return total


ASYNC_FROM_ENVS = 4
"""``--vector auto`` steps this many envs or more in worker processes: where `splitrl bench vector` finds
AsyncVectorEnv faster (docs/benchmarks/vector.md)."""


def choose_vector(mode: str, num_envs: int) -> str:
    """'sync' or 'async' for ``--vector mode``; 'auto' is async from `ASYNC_FROM_ENVS` envs on. (A pipelined
    rollout of fewer envs may still want 'async': its groups' envs then step at once, `StepInTwo`.)"""
    if mode not in VECTOR_MODES:
        raise ValueError(f"vector must be one of {', '.join(VECTOR_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "async" if num_envs >= ASYNC_FROM_ENVS else "sync"


def make_vector_env(settings: EnvSettings, *, vector: str = "sync", reward_gamma: float | None = None,
                    reward_clip: float = 0.0, nice: int = 0) -> tuple[gym.vector.VectorEnv, StepInTwo]:
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

    ``nice``: the worker processes run this much nicer than this one (`lower_priority`).
    """
    if vector not in ("sync", "async"):
        raise ValueError(f"vector must be 'sync' or 'async' (`choose_vector` resolves 'auto'), got {vector!r}")
    thunks: list[Callable[[], gym.Env]] = [lambda: make_single_env(settings)] * settings.num_envs
    if vector == "async":
        base: gym.vector.VectorEnv = gym.vector.AsyncVectorEnv(thunks, autoreset_mode=AutoresetMode.SAME_STEP,
                                                               context="spawn",
                                                               worker=_worker_deaf_to_ctrl_c if _async_worker else None)
        lower_priority([process.pid for process in base.processes], nice)
    else:
        base = gym.vector.SyncVectorEnv(thunks, autoreset_mode=AutoresetMode.SAME_STEP)
    stepper = StepInTwo(base)
    envs: gym.vector.VectorEnv = gym.wrappers.vector.RecordEpisodeStatistics(stepper)
    if reward_gamma is not None:
        envs = gym.wrappers.vector.NormalizeReward(envs, gamma=reward_gamma)
        if reward_clip > 0:
            envs = gym.wrappers.vector.ClipReward(envs, -reward_clip, reward_clip)
    return envs, stepper


def lower_priority(pids: list[int], nice: int) -> None:
    """Run the processes ``pids`` (this process's env workers) ``nice`` steps nicer than this process, at most 19.

    On two cores a pipelined rollout has more runnable processes than cores: the env workers of one group, and
    the stages' threads taking another group through the encoder, the link and the heads. The stages' work is the
    rollout's critical path; an env step begun a turn ahead has time to spare. At equal niceness Linux shares the
    cores alike and a stage's thread waits behind a worker; a nicer worker yields to it. Sample Factory lowers its
    rollout workers' priority for the same reason (`sample_factory/algo/sampling/rollout_worker.py`).
    Raising a child's niceness needs no privilege; where the system has no such call, nothing is done."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    for pid in pids:
        try:
            os.setpriority(os.PRIO_PROCESS, pid, niceness)
        except ProcessLookupError:  # a worker that died at start-up: the vector env reports it on the first call
            pass


try:
    from gymnasium.vector.async_vector_env import _async_worker
except ImportError:  # pragma: no cover - a gymnasium that renamed its worker: use its own (Ctrl-C tracebacks and all)
    _async_worker = None


def _worker_deaf_to_ctrl_c(*args: Any, **kwargs: Any) -> None:
    """gymnasium's AsyncVectorEnv worker, ignoring SIGINT. Ctrl-C in a terminal reaches the whole process group
    (and `splitrl run` stops its stages' groups so): a worker that took it would write to a pipe its parent is
    closing and print a BrokenPipeError traceback per env. Its parent stops it instead (``close``; or the
    worker reads the end of its pipe when the parent is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()
    _async_worker(*args, **kwargs)


_WRAPPER_STATE = {
    "RecordEpisodeStatistics": ("episode_count", "episode_start_times", "episode_returns", "episode_lengths",
                                "prev_dones", "time_queue", "return_queue", "length_queue"),
    "NormalizeReward": ("accumulated_reward", "_prev_dones", "_update_running_mean"),
}
"""What gymnasium's vector wrappers (1.x) keep between steps; NormalizeReward's running statistics as well."""


def vector_env_state(envs: gym.vector.VectorEnv) -> dict[str, Any]:
    """Everything that determines the envs' future: each env's `Replayable.snapshot` and the wrappers' state."""
    wrappers: dict[str, Any] = {}
    layer: Any = envs
    while isinstance(layer, gym.vector.VectorWrapper):
        name = type(layer).__name__
        state = {key: _plain(getattr(layer, key)) for key in _WRAPPER_STATE.get(name, ())}
        if name == "NormalizeReward":
            rms = layer.return_rms
            state["return_rms"] = (copy.deepcopy(rms.mean), copy.deepcopy(rms.var), rms.count)
        if state:
            wrappers[name] = state
        layer = layer.env
    return {"envs": list(envs.unwrapped.call("snapshot")), "wrappers": wrappers}


def restore_vector_env(envs: gym.vector.VectorEnv, state: dict[str, Any]) -> np.ndarray:
    """Put ``envs`` (reset already) back into ``state`` (`vector_env_state`); the observations it ends at."""
    if len(state["envs"]) != envs.num_envs:
        raise ValueError(f"the saved state has {len(state['envs'])} envs, these are {envs.num_envs}")
    envs.unwrapped.set_attr("pending", list(state["envs"]))  # each env (in its worker, if any) takes its own
    obs = batch(list(envs.unwrapped.call("restore")))
    layer: Any = envs
    while isinstance(layer, gym.vector.VectorWrapper):
        saved = state["wrappers"].get(type(layer).__name__, {})
        for key, value in saved.items():
            if key == "return_rms":
                layer.return_rms.mean, layer.return_rms.var, layer.return_rms.count = copy.deepcopy(value)
            elif isinstance(getattr(layer, key), deque):  # the live queue keeps its own length limit
                setattr(layer, key, deque(copy.deepcopy(value), maxlen=getattr(layer, key).maxlen))
            else:
                setattr(layer, key, copy.deepcopy(value))
        layer = layer.env
    return obs


def _plain(value: Any) -> Any:
    """A wrapper's value as a checkpoint holds it: a queue as a list (`restore_vector_env` refills the live one)."""
    return list(copy.deepcopy(value)) if isinstance(value, deque) else copy.deepcopy(value)


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
    """Build one environment to check it is usable; raise SettingsError saying why not."""
    try:
        env = make_single_env(settings)
    except SettingsError:
        raise
    except gym.error.Error as exc:
        raise SettingsError(f"--env-id {settings.env_id!r}: {exc}") from None
    except Exception as exc:  # wrappers reject unsuitable spaces with assorted errors
        raise SettingsError(f"--env-id {settings.env_id!r} cannot be used with this observation pipeline: {exc}") from None
    try:
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    discrete = isinstance(act_space, gym.spaces.Discrete)
    if not discrete and (not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) != 1):
        raise SettingsError(f"--env-id {settings.env_id!r}: expected a Discrete or a 1-d Box action space, "
                            f"got {act_space}")
    if discrete and act_space.n < 2:
        raise SettingsError(f"--env-id {settings.env_id!r}: a Discrete action space needs 2 or more actions, "
                            f"got {act_space}")
    if not discrete and not (np.all(np.isfinite(act_space.low)) and np.all(np.isfinite(act_space.high))):
        raise SettingsError(f"--env-id {settings.env_id!r}: the action space must be bounded, got {act_space}")
    kind = observation_kind(obs_space)
    if kind is None:
        raise SettingsError(
            f"--env-id {settings.env_id!r}: expected image observations (a uint8 Box of 2 or more dims), a state "
            f"vector (a 1-d Box) or a Dict of one image and vectors, got {obs_space}")
    observation: dict[str, Any] = {"observation": kind}
    if kind == IMAGE:
        sample = np.zeros((1,) + obs_space.shape, dtype=np.uint8)
        shape = to_chw(sample, stacked=settings.image_pipeline[1] > 1).shape[1:]
    elif kind == VECTOR:
        shape = obs_space.shape
    else:
        image = next(k for k, s in obs_space.spaces.items() if _is_image(s))
        vectors = [k for k in obs_space.spaces if k != image]
        shape = to_chw(np.zeros((1,) + obs_space[image].shape, dtype=np.uint8), stacked=False).shape[1:]
        observation.update(keys=(image, *vectors), vector_dim=sum(int(obs_space[k].shape[0]) for k in vectors))
    obs_shape = tuple(int(d) for d in shape)
    if discrete:
        start, n = int(act_space.start), int(act_space.n)
        return EnvSpec(obs_shape=obs_shape, action_dim=n, action_low=(float(start),),
                       action_high=(float(start + n - 1),), discrete=True, **observation)
    return EnvSpec(
        obs_shape=obs_shape,
        action_dim=int(act_space.shape[0]),
        action_low=tuple(float(x) for x in act_space.low),
        action_high=tuple(float(x) for x in act_space.high),
        **observation,
    )


if "splitrl/PickByCue-v0" not in gym.registry:  # the Dict env of `splitrl.pick_by_cue`, imported when made
    gym.register("splitrl/PickByCue-v0", entry_point="splitrl.pick_by_cue:PickByCue")
