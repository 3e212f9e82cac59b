"""A tiny discrete-action pixel environment the tests build themselves (no ROMs needed).

Importing this module registers ``splitrl_test/Dots-v0``. The stage processes are
started as ``python -m splitrl ...``, so they reach it through gymnasium's
``module:env_id`` syntax: ``--env-id tests.dots:splitrl_test/Dots-v0`` makes
`gymnasium.make` import this module (the tests put the repository on PYTHONPATH)
before it looks the id up.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["DotsEnv", "ENV_ID", "DOTS_ENV_ID"]

ENV_ID = "splitrl_test/Dots-v0"
DOTS_ENV_ID = f"{__name__}:{ENV_ID}"
"""What ``--env-id`` takes in a process that has not imported this module."""


class DotsEnv(gym.Env):
    """A red block and a green one on a row of ``cells`` cells; actions move the red block left, keep it, or
    move it right. Reaching the green block ends the episode with reward 1; every other step costs 0.01.

    Deterministic given the reset's seed. ``start`` is the Discrete space's first action (gymnasium's
    ``Discrete(3, start=...)``); an action outside the space is an error, not a silent clip, so a test
    catches a stage that passes the env the wrong thing.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, size: int = 48, cells: int = 6, start: int = 0, render_mode: str | None = None) -> None:
        if size < 36 or size // cells < 2:
            raise ValueError(f"Dots: need size >= 36 (the CNN's smallest input) and 2+ pixels a cell, got "
                             f"size={size}, cells={cells}")
        self.size, self.cells, self.render_mode = size, cells, render_mode
        self.observation_space = gym.spaces.Box(0, 255, (size, size, 3), dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(3, start=start)
        self.agent = self.target = 0

    def _frame(self) -> np.ndarray:
        frame = np.zeros((self.size, self.size, 3), dtype=np.uint8)
        width = self.size // self.cells
        top = self.size // 2 - width // 2
        frame[top: top + width, self.target * width: (self.target + 1) * width, 1] = 255
        frame[top: top + width, self.agent * width: (self.agent + 1) * width, 0] = 255
        return frame

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.agent, self.target = (int(x) for x in self.np_random.choice(self.cells, size=2, replace=False))
        return self._frame(), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"Dots: action {action!r} is not in {self.action_space}")
        move = int(action) - int(self.action_space.start) - 1
        self.agent = min(max(self.agent + move, 0), self.cells - 1)
        reached = self.agent == self.target
        return self._frame(), 1.0 if reached else -0.01, reached, False, {}

    def render(self) -> np.ndarray:
        return self._frame()


if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=DotsEnv, max_episode_steps=50)
