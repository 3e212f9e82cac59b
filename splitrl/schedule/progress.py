"""A progress bar inside each iteration, on a terminal: the rollout's env steps, then training's minibatches,
with their rate and the bytes that crossed the link since the iteration began.

Stage0 (or the twin) draws it on stderr, where the one line per iteration goes (`IterationLog` closes the bar
before it writes that line, so the lines stay as they are and the bar is redrawn under them). It is drawn only
when stderr is a terminal; ``SPLITRL_PROGRESS=1`` draws it anyway, ``0`` never (`bar_wanted`). The
asynchronous schedule collects the next rollout while an iteration trains: the steps taken meanwhile are
counted into the next iteration's rollout part.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, TextIO

from ..settings import TrainSettings
from ..stages.progress import Progress
from ..transport import ByteMeter

__all__ = ["PROGRESS_ENV", "bar_wanted", "IterationBar"]

PROGRESS_ENV = "SPLITRL_PROGRESS"
"""``1``: draw the bar even where stderr is no terminal; ``0``: never draw it; unset: on a terminal only."""


def bar_wanted(stream: TextIO | None = None) -> bool:
    """Whether to draw the bar on ``stream`` (default stderr): `PROGRESS_ENV`, else whether it is a terminal."""
    stream = sys.stderr if stream is None else stream
    said = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if said in ("1", "on", "true", "yes"):
        return True
    if said in ("0", "off", "false", "no"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


class IterationBar(Progress):
    """One tqdm bar an iteration: `begin` opens it on the rollout (env steps of this edge), the first
    `minibatch` turns it to training (``epochs x minibatches``), `end` closes it. Its postfix is what the
    meter counted since `begin`, each way as stage0 sees it. Thread-safe: the asynchronous schedule's rollout
    thread tells of steps while its training thread tells of minibatches."""

    def __init__(self, settings: TrainSettings, meter: ByteMeter, stream: TextIO | None = None) -> None:
        self.meter = meter
        self.stream = sys.stderr if stream is None else stream
        self.rollout_total = settings.ppo.num_steps * settings.env.num_envs
        self.train_total = settings.ppo.epochs * settings.ppo.minibatches
        self.phase = "idle"
        """'rollout', 'train', or 'idle' between an iteration's `end` and the next `begin`."""
        self.ahead = 0
        """Steps taken outside a rollout part (the asynchronous schedule's next rollout): the next one's."""
        self._bar: Any = None
        self._start = (0, 0)
        self._lock = threading.Lock()

    def begin(self) -> None:
        from tqdm import tqdm

        with self._lock:
            self._start = (self.meter.total("sent"), self.meter.total("recv"))
            self._bar = tqdm(total=self.rollout_total, desc="rollout", unit="step", file=self.stream, leave=False,
                             dynamic_ncols=True, mininterval=0.2)
            self.phase = "rollout"
            done, self.ahead = min(self.ahead, self.rollout_total), 0
            self._advance(done)

    def steps(self, n: int) -> None:
        with self._lock:
            if self.phase == "rollout":
                self._advance(n)
            else:
                self.ahead += n

    def minibatch(self) -> None:
        with self._lock:
            if self.phase == "idle":
                return
            if self.phase == "rollout":
                self.phase = "train"
                self._bar.set_description_str("train", refresh=False)
                self._bar.unit = "mb"
                self._bar.miniters = 0  # as new: the rollout's many steps a redraw would hold back a minibatch's
                self._bar.reset(total=self.train_total)
            self._advance(1)

    def end(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
            self._bar, self.phase = None, "idle"

    def _advance(self, n: int) -> None:
        sent, recv = (self.meter.total(d) - before for d, before in zip(("sent", "recv"), self._start))
        self._bar.set_postfix_str(f"link sent {_megabytes(sent)} recv {_megabytes(recv)}", refresh=False)
        self._bar.update(n)


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f} MB"
