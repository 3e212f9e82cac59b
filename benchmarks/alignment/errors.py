"""How the probe says a run broke an invariant, or that it could not check one."""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["Alarm", "InvariantBroken", "ProbeError", "broken"]


class InvariantBroken(Exception):
    """The first invariant the run broke; its message is the report."""


class ProbeError(Exception):
    """The probe could not do its job (settings it does not cover, a hold that timed out)."""


def broken(invariant: str, what: str, iteration: int, where: str, detail: str) -> InvariantBroken:
    """The report of invariant ``invariant`` (a letter) broken at ``iteration``, ``where`` in it."""
    return InvariantBroken(f"async probe: invariant ({invariant}) {what} broken at iteration {iteration}, "
                           f"{where}: {detail}")


class Alarm:
    """The run's first broken invariant, and the condition the probe's threads share.

    The twin may surface an error from a stage's thread as another exception (or a timeout), so the first
    `InvariantBroken` is kept here as it leaves the probe's code, for `main` to report, and it wakes every wait
    of ``--hold``."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.failure: InvariantBroken | None = None

    def record(self, error: InvariantBroken) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = error
            self.cond.notify_all()

    def guard(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """``hook``, recording any broken invariant it raises before it propagates."""
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return hook(*args, **kwargs)
            except InvariantBroken as error:
                self.record(error)
                raise
        return guarded
