"""Stage0's finished episodes: their returns until a rollout summary takes them, their moving average, and the
run log's line for each."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..runs import EMA_DECAY, RunLog

__all__ = ["Episodes"]


class Episodes:
    """The returns of the episodes finished since `take` last took them, and their EMA (`EMA_DECAY`)."""

    def __init__(self, run_log: RunLog | None) -> None:
        self.run_log = run_log
        self.ema_return: float | None = None
        self.returns: list[float] = []
        self._lock = threading.Lock()  # the asynchronous schedule takes them from its training thread

    def record(self, info: dict[str, Any], envs: Any, global_step: int, iteration: int) -> None:
        """The episodes a vector env's step ``info`` says have finished; ``envs``: its envs' fleet indices."""
        if "episode" not in info:
            return
        for i in np.flatnonzero(info["_episode"]):
            r, length = float(info["episode"]["r"][i]), int(info["episode"]["l"][i])
            self.ema_return = r if self.ema_return is None else EMA_DECAY * self.ema_return + (1 - EMA_DECAY) * r
            with self._lock:
                self.returns.append(r)
            if self.run_log is not None:
                self.run_log.episode({"global_step": global_step, "iteration": iteration, "env": int(envs[i]),
                                      "return": r, "length": length, "ema_return": self.ema_return})

    def take(self) -> list[float]:
        """The returns finished since the last call."""
        with self._lock:
            returns, self.returns = self.returns, []
        return returns
