"""A stop signal is never lost, even where a C extension drops the KeyboardInterrupt it raised (`splitrl.stops`)."""

import os
import posixpath
import signal

import numpy as np
import pygame
import pytest

from splitrl import stops
from splitrl.envs import make_single_env
from splitrl.settings import EnvSettings


@pytest.fixture
def handlers(monkeypatch):
    """`stops.install` in this process, as a command has it, from a process that took no stop yet."""
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(stops, "_first_stop", None)
    monkeypatch.setattr(stops, "_stops", 0)
    stops.install()
    yield
    for s, handler in old.items():
        signal.signal(s, handler)


def _ctrl_c_inside_pygames_font(monkeypatch) -> list[str]:
    """The next time pygame's font looks at its file's path, SIGINT reaches this process: its handler runs inside
    that call back into Python. Returns the paths it was sent at. The font module is shut down first, so that
    the next frame opens the font again (`splitrl.carracing` keeps it open otherwise; gymnasium opens it for
    every frame)."""
    pygame.font.quit()
    real, sent = posixpath.isabs, []

    def isabs(path):
        if not sent:
            sent.append(path)
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode, still in pygame's call
        return real(path)

    monkeypatch.setattr(posixpath, "isabs", isabs)
    return sent


def test_a_ctrl_c_that_pygame_drops_still_stops_the_envs_step(handlers, monkeypatch):
    env = make_single_env(EnvSettings())
    try:
        env.reset(seed=1)
        action = np.zeros(3, np.float32)
        sent = _ctrl_c_inside_pygames_font(monkeypatch)
        env.unwrapped.step(action)  # under the wrappers: the stop is taken and dropped, the step goes on
        assert sent and stops.taken() == 1

        monkeypatch.setattr(stops, "_first_stop", None)  # the next signal is a stop of its own, not a repeat
        sent = _ctrl_c_inside_pygames_font(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            env.step(action)
        assert sent and stops.taken() == 2
    finally:
        env.close()


def test_a_second_signal_soon_after_the_first_is_the_same_stop(handlers):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs before the next line
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, right after a terminal's Ctrl-C: dropped
    assert stops.taken() == 1
    with stops.kept():
        pass
