"""``--hold``: the largest lag, made to happen whatever the machine's timing.

Version i is published only once the rollout of i + S has sent its first step, and that rollout's second step
waits for the publish, so every rollout after the S-th starts at lag S and swaps versions in flight. The waits
are condition waits on the probe's shared condition, not sleeps; a broken invariant on the other thread ends
them.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

from .errors import Alarm, ProbeError
from .record import Record

__all__ = ["HOLD_TIMEOUT", "Hold"]

HOLD_TIMEOUT = 60.0
"""Seconds a ``--hold`` wait gives the other thread before the probe gives up (exit 2)."""


class Hold:
    """Paces stage0's rollout and its publishes as the module's doc says."""

    def __init__(self, alarm: Alarm, rec: Record) -> None:
        self.alarm, self.rec = alarm, rec
        self.adopts: Counter[int] = Counter()
        """Adopts (one a step) of each iteration's rollout so far."""
        self.published: set[int] = set()

    def adopting(self, j: int) -> None:
        """Stage0 adopts a version for a step of rollout ``j``: its second step waits for version j - S."""
        S = self.rec.run.bound
        self.adopts[j] += 1
        if self.adopts[j] == 2 and j - S >= 1:
            self._wait(lambda: j - S in self.published, f"version {j - S} to be published")

    def publishing(self, i: int) -> None:
        """Stage0 is about to publish what iteration ``i`` trained: not before rollout i + S has started."""
        S = self.rec.run.bound
        if i + S <= self.rec.run.settings.num_iterations:
            self._wait(lambda: (i + S, 0, 0) in self.rec.s0_steps, f"the rollout of iteration {i + S} to start")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        alarm, deadline = self.alarm, time.monotonic() + HOLD_TIMEOUT
        with alarm.cond:
            while not ready():
                if alarm.failure is not None:
                    raise alarm.failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProbeError(f"--hold waited {HOLD_TIMEOUT:g} s for {what}")
                alarm.cond.wait(min(left, 0.5))
