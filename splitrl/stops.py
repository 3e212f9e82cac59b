"""How a process stops on SIGINT and SIGTERM: a KeyboardInterrupt, raised once, and kept.

Every `splitrl` command installs `install`. A stop signal raises KeyboardInterrupt in the main thread, between
two bytecodes of whatever Python runs there, and a C extension that calls back into Python may clear it as any
other error of the call: pygame's font, which CarRacing opens to draw a frame (gymnasium's for every frame;
`splitrl.carracing` keeps it open, and opens it again once pygame's font module was shut down), resolves its
path through ``os.path`` and drops what that raised, so a Ctrl-C that lands there is lost and the stage steps on
(tests/test_stops.py shows it). Calls into such code run under `kept`, which raises the stop again if it did not
come out."""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any, Iterator

__all__ = ["install", "kept", "taken"]

REPEAT_WINDOW_S = 2.0
"""A second stop signal this soon after the first is the same stop (see `_interrupt`)."""

_first_stop: float | None = None
_stops = 0


def taken() -> int:
    """How many stop signals this process has taken (repeats within `REPEAT_WINDOW_S` not counted)."""
    return _stops


def _interrupt(signum: int, frame: Any) -> None:
    """Stop by raising KeyboardInterrupt; a second signal within `REPEAT_WINDOW_S` is the same stop and is
    dropped. A terminal's Ctrl-C reaches `splitrl run` and both stages at once, and the launcher then sends each
    stage SIGTERM: raised again, that cut the stage's cleanup short (a traceback from wherever it landed, a
    socket's deallocation once). A later one still interrupts a cleanup that hangs."""
    global _first_stop, _stops
    now = time.monotonic()
    if _first_stop is not None and now - _first_stop < REPEAT_WINDOW_S:
        return
    _first_stop = now
    _stops += 1
    raise KeyboardInterrupt(signal.Signals(signum).name)


def install() -> None:
    """SIGINT and SIGTERM both stop the process the same way: tell the peer, clean up, exit 130.

    SIGINT is set explicitly because a process started in the background by a
    non-interactive shell inherits it ignored.
    """
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Run the block; a stop signal taken in it whose KeyboardInterrupt did not come out (code below it swallowed
    it) is raised at its end."""
    before = _stops
    yield
    if _stops != before:
        raise KeyboardInterrupt("a stop signal that the code it landed in dropped")
