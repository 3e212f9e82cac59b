"""Stage0's environments: one vector env per group of envs that step in turn (`splitrl.stages.rollouts.Groups`).

Each group's step is begun and finished apart (`splitrl.envs.StepInTwo`): with ``vector='async'`` its envs step
in worker processes meanwhile, so the pipelined schedule has two groups' envs stepping at once. Env i is seeded
alike whatever the grouping, and a checkpoint's env state is put back when the envs open.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..envs import choose_vector, make_vector_env, restore_vector_env, vector_env_state, worker_cpu_seconds
from ..settings import TrainSettings
from .rollouts import Groups

__all__ = ["EnvGroups", "training_envs"]


def training_envs(settings: TrainSettings, env: Any = None, vector: str = "sync", nice: int = 0) -> tuple[Any, Any]:
    """The vector env (and its `StepInTwo`) of ``env`` (default ``settings.env``) as a run trains on it: the
    reward's clipping and normalisation of ``settings.ppo`` around the env's own pipeline (``nice``: the worker
    processes' niceness above this process's, `make_vector_env`)."""
    return make_vector_env(settings.env if env is None else env, vector=vector, reward_clip=settings.ppo.reward_clip,
                           reward_gamma=settings.ppo.gamma if settings.ppo.norm_reward else None, nice=nice)


class EnvGroups:
    """The ``num_envs`` envs of ``settings``, in `groups` of one vector env each (`set_groups`, then `open`)."""

    def __init__(self, settings: TrainSettings, vector: str = "auto", nice: int = 0) -> None:
        self.settings = settings
        self.vector = choose_vector(vector, settings.env.num_envs)
        """'sync': the environments step in this process; 'async': in worker processes (`splitrl.envs.StepInTwo`)."""
        self.nice = nice
        """How much nicer than this process the worker processes run (``--env-nice``)."""
        self.groups = Groups(settings.env.num_envs)
        self.envs: list[Any] = []
        self.steppers: list[Any] = []
        self.next_obs: list[np.ndarray] = []
        """Each group's observations after its last step: what it acts on next."""
        self.actions: list[np.ndarray | None] = [None]
        self.saved: list[dict[str, Any]] | None = None
        """The envs' state from a checkpoint (`state`), put back by `open`."""

    def set_groups(self, groups: int) -> None:
        """Cut the envs into ``groups`` equal groups that step in turn (before `open`)."""
        if self.envs:
            raise ValueError("the envs are open already: their groups are set before")
        self.groups = Groups(self.settings.env.num_envs, groups)
        self.actions = [None] * groups

    def open(self, seed: int) -> None:
        """Each group's vector env, reset so that env i has seed ``seed + i`` whatever the grouping."""
        s = self.settings
        if self.saved is not None and len(self.saved) != len(self.groups):
            raise ValueError(f"the checkpoint's rollout had {len(self.saved)} env groups, this run has "
                             f"{len(self.groups)}: resume with the same --rollout-groups")
        group_env = dataclasses.replace(s.env, num_envs=self.groups.size)
        for g, rows in enumerate(self.groups.rows):
            env, stepper = training_envs(s, group_env, self.vector, self.nice)
            self.envs.append(env)
            self.steppers.append(stepper)
            obs = env.reset(seed=seed + int(rows[0]))[0]
            self.next_obs.append(obs if self.saved is None else restore_vector_env(env, self.saved[g]))
        self.saved = None

    def begin_step(self, g: int, action: np.ndarray) -> None:
        """Start stepping group ``g`` with ``action`` (the envs' own)."""
        self.actions[g] = action
        self.steppers[g].begin(action)

    def finish_step(self, g: int) -> tuple[Any, Any, Any, dict[str, Any]]:
        """Wait for group ``g``'s step: its (reward, terminated, truncated, info); its next observations kept."""
        self.next_obs[g], reward, terminated, truncated, info = self.envs[g].step(self.actions[g])
        return reward, terminated, truncated, info

    def cpu_seconds(self) -> float | None:
        """CPU seconds the envs' worker processes have used so far (0: the envs step in this process; None: not
        measurable here, or no envs open)."""
        seconds = [worker_cpu_seconds(stepper) for stepper in self.steppers]
        return None if not seconds or None in seconds else sum(seconds)

    def state(self) -> list[dict[str, Any]]:
        """Each group's envs' state, for a checkpoint (`saved`)."""
        return [vector_env_state(envs) for envs in self.envs]

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs, self.steppers = [], []
