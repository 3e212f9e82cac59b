"""What stage0 reports as an iteration goes: env steps taken, training minibatches done.

`Edge.progress` is told of each (`Edge.finish_step`; `splitrl.schedule.training.stage0_train`); this one tells no
one. A terminal's progress bar (`splitrl.schedule.progress.IterationBar`) is one that shows them.
"""

from __future__ import annotations

__all__ = ["Progress"]


class Progress:
    """Told of stage0's work as it happens; does nothing with it (a listener overrides both)."""

    def steps(self, n: int) -> None:
        """``n`` env steps were taken (one step of an env group of ``n`` envs)."""

    def minibatch(self) -> None:
        """One training minibatch ended (its optimizer step taken)."""
