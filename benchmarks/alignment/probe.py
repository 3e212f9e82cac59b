"""One probe of one twin run: the record, the two stages' hooks that fill it and check it, and the run's end."""

from __future__ import annotations

from typing import Any

from .checks import check_neighbours
from .errors import Alarm, InvariantBroken
from .hold import Hold
from .record import Record
from .run import Run
from .stage0 import EdgeWatch
from .stage1 import LearnerWatch
from .summary import Tally, summary

__all__ = ["Probe"]


class Probe:
    """Records both stages of one twin run and checks every iteration they train (benchmarks/async_probe.py says
    what). Stage1 is built first: its settings say what the checks expect."""

    def __init__(self, hold: bool = False, plant: str | None = None) -> None:
        self.plant = plant
        self.alarm = Alarm()
        self.run = Run()
        self.rec = Record.new(self.run, self.alarm.cond)
        self.tally = Tally()
        self.hold = Hold(self.alarm, self.rec) if hold else None
        self.stage0 = EdgeWatch(self.rec, self.tally, self.alarm, self.hold)
        self.stage1 = LearnerWatch(self.rec, self.tally, self.alarm)

    @property
    def failure(self) -> InvariantBroken | None:
        """The first invariant the run broke, wherever it was raised."""
        return self.alarm.failure

    def take_settings(self, settings: Any) -> None:
        self.run.take(settings, hold=self.hold is not None, plant=self.plant)

    def watch_edge(self, edge: Any) -> None:
        self.alarm.guard(self.stage0.watch)(edge, self.plant)

    def watch_learner(self, learner: Any) -> None:
        self.alarm.guard(self.stage1.watch)(learner, self.plant)

    def finish(self) -> dict[str, Any]:
        """Checks of the whole run; the summary line's contents."""
        n = self.run.settings.num_iterations
        self.tally.covered(n, self.run.settings.schedule.rescore)
        check_neighbours(self.tally, n)
        return summary(self.tally, self.rec, hold=self.hold is not None)
