"""What the checks saw over a run, and the line that reports it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import splitrl

from .errors import ProbeError
from .record import Record

__all__ = ["Tally", "summary"]


@dataclass
class Tally:
    """Counts the checks keep as they go: what was checked, and how close it came."""

    checked: Counter[str] = field(default_factory=Counter)
    lags: Counter[int] = field(default_factory=Counter)
    """Samples by their lag, in versions."""
    swaps: int = 0
    """Rollouts (of one group) that acted with more than one version."""
    truncations: int = 0
    neighbour_tried: int = 0
    neighbour_differs: int = 0
    """Samples scored with a neighbouring version, and how many of those it did not reproduce."""
    max_err: dict[str, float] = field(default_factory=lambda: {"logprob": 0.0, "value": 0.0, "features": 0.0,
                                                               "bootstrap": 0.0})

    def covered(self, n: int, rescore: bool) -> None:
        """Every one of the run's ``n`` iterations was checked on both stages, or the probe missed some."""
        for what in ("stage0 rollouts", "stage1 rollouts", "stage0 trainings", "stage1 trainings"):
            if self.checked[what] != n:
                raise ProbeError(f"checked {self.checked[what]} {what} of {n} iterations")
        if rescore and self.checked["rescored rollouts"] != n:
            raise ProbeError(f"checked {self.checked['rescored rollouts']} rescored rollouts of {n} iterations")


def summary(tally: Tally, rec: Record, hold: bool) -> dict[str, Any]:
    """The summary line's contents."""
    run = rec.run
    settings, n = run.settings, run.settings.num_iterations
    return {
        "ok": True, "splitrl": str(Path(splitrl.__file__).parent), "mode": settings.schedule.mode,
        "max_staleness": run.bound, "hold": hold, "versions_per_iteration": run.per_iteration,
        "iterations": n, "samples": sum(tally.lags.values()),
        "invariants": ["a observations", "b outcomes", "c behaviour", "d versions", "e training data"]
        + (["f rescore"] if settings.schedule.rescore else []),
        "rescored_rollouts": tally.checked["rescored rollouts"],
        "lags": {str(k): v for k, v in sorted(tally.lags.items())},
        "rollouts_swapping_in_flight": tally.swaps, "truncations": tally.truncations,
        "neighbour_samples": tally.neighbour_tried, "neighbour_mismatches": tally.neighbour_differs,
        "max_abs_err": {k: float(f"{v:.3g}") for k, v in tally.max_err.items()},
        "minibatch_parts": sum(len(p) for p in rec.training["stage1"].parts.values()),
    }
