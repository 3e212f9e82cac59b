"""PickByCue: a tiny env of Dict observations, a camera and a cue, whose reward needs both.

`splitrl.envs` registers it as ``splitrl/PickByCue-v0`` (``--env-id splitrl/PickByCue-v0``).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["PickByCue", "COLOURS"]

COLOURS = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0]], dtype=np.uint8)
"""The patches' colours, in the cue's order: red, green, blue, yellow."""


class PickByCue(gym.Env):
    """An image of ``cells`` cells in a row, ``colours`` of them lit, each in a colour of its own, and a cue: a
    one-hot vector naming one of those colours. The action picks a cell; reward 1 when it holds the cued colour,
    0 otherwise. Every step is a new scene (cells, colours and cue drawn afresh); an episode is ``rounds`` steps.

    Neither half is enough: the image alone says where the colours are, not which one to pick (at best 1 in
    ``colours``), the cue alone which colour, not where (1 in ``cells``); both together, every pick. A policy
    that picks at random scores ``rounds / cells`` an episode, the best ``rounds``. Observations: ``image``
    (``size`` x ``size`` x 3 uint8, the cells side by side, each ``size // cells`` pixels wide and ``size // 2``
    high, centred) and ``cue`` (``colours`` float32, one-hot). Deterministic given the reset's seed.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, size: int = 16, cells: int = 4, colours: int = 2, rounds: int = 8,
                 render_mode: str | None = None) -> None:
        if not 2 <= colours <= min(cells, len(COLOURS)) or size // cells < 1 or rounds < 1:
            raise ValueError(f"PickByCue: need 2 <= colours <= min(cells, {len(COLOURS)}), a pixel a cell and a "
                             f"round, got size={size}, cells={cells}, colours={colours}, rounds={rounds}")
        self.size, self.cells, self.colours, self.rounds = size, cells, colours, rounds
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Dict({
            "image": gym.spaces.Box(0, 255, (size, size, 3), dtype=np.uint8),
            "cue": gym.spaces.Box(0.0, 1.0, (colours,), dtype=np.float32),
        })
        self.action_space = gym.spaces.Discrete(cells)
        self.where = np.zeros(colours, dtype=np.int64)
        """The cell each colour lights."""
        self.cue, self.round = 0, 0

    def _draw(self) -> None:
        self.where = self.np_random.choice(self.cells, size=self.colours, replace=False)
        self.cue = int(self.np_random.integers(self.colours))

    def _obs(self) -> dict[str, np.ndarray]:
        cue = np.zeros(self.colours, dtype=np.float32)
        cue[self.cue] = 1.0
        return {"image": self.render(), "cue": cue}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.round = 0
        self._draw()
        return self._obs(), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"PickByCue: action {action!r} is not in {self.action_space}")
        reward = 1.0 if int(action) == int(self.where[self.cue]) else 0.0
        self.round += 1
        self._draw()
        return self._obs(), reward, self.round >= self.rounds, False, {}

    def render(self) -> np.ndarray:
        frame = np.zeros((self.size, self.size, 3), dtype=np.uint8)
        width, top = self.size // self.cells, self.size // 4
        for colour, cell in enumerate(self.where):
            frame[top: top + self.size // 2, cell * width: (cell + 1) * width] = COLOURS[colour]
        return frame
