"""The progress bar inside each iteration: drawn on a terminal (rollout steps, then training minibatches, the rate
and the link's bytes), and off elsewhere, where the output is the one line per iteration it always was."""

from __future__ import annotations

import io
import json
import os
import re
import select
import subprocess
import time

import pytest

from splitrl.schedule.common import progress_line
from splitrl.schedule.progress import PROGRESS_ENV, IterationBar, bar_wanted
from splitrl.settings import EnvSettings, PPOSettings, TrainSettings
from splitrl.transport import ByteMeter

from ..conftest import child_env, splitrl_cmd

CARTPOLE = ["--env-id", "CartPole-v1", "--total-steps", "1024", "--num-steps", "256", "--num-envs", "2",
            "--epochs", "2", "--minibatches", "8", "--threads", "1"]
"""Two iterations of a fast env, long enough for the bar to be redrawn within each."""
ITERATION_LINE = re.compile(r"^\d\d:\d\d:\d\d \[stage0\] (iter .*)$")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_counts_the_rollout_then_the_minibatches_with_the_link_bytes():
    settings = TrainSettings(env=EnvSettings(num_envs=2), ppo=PPOSettings(num_steps=4, epochs=2, minibatches=3))
    meter, stream = ByteMeter(), io.StringIO()
    bar = IterationBar(settings, meter, stream)
    bar.begin()
    assert (bar._bar.desc, bar._bar.total, bar._bar.n) == ("rollout", 8, 0)
    for _ in range(4):
        bar.steps(2)  # a step of both envs
    meter.add("step", "sent", 2_500_000, 2)
    meter.add("action", "recv", 30_000, 2)
    bar.minibatch()
    assert (bar._bar.desc, bar._bar.unit, bar._bar.total, bar._bar.n) == ("train", "mb", 6, 1)
    bar.minibatch()
    bar._bar.refresh()
    bar.end()
    text = stream.getvalue()
    assert "rollout:" in text and "step/s" in text
    assert "train:" in text and "2/6" in text and "mb/s" in text and "link sent 2.50 MB recv 0.03 MB" in text
    assert bar._bar is None and bar.phase == "idle"
    bar.steps(2)  # the asynchronous schedule's next rollout, stepping before its iteration begins
    bar.minibatch()  # no iteration: nothing to count
    bar.begin()
    assert bar._bar.n == 2 and bar._bar.desc == "rollout"
    bar.end()


def test_the_bar_is_drawn_on_a_terminal_unless_told(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert bar_wanted(_Terminal()) and not bar_wanted(io.StringIO())
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert bar_wanted(io.StringIO())
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert not bar_wanted(_Terminal())


def _iteration_lines(output: str) -> list[str]:
    return [m.group(1) for line in output.splitlines() if (m := ITERATION_LINE.match(line.rstrip()))]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_off_a_terminal_the_output_is_one_line_per_iteration_and_no_bar(tmp_path):
    env = child_env()
    env.pop(PROGRESS_ENV, None)
    done = subprocess.run(splitrl_cmd("train", "--run-dir", str(tmp_path / "run"), *CARTPOLE), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path / "run")
    assert _iteration_lines(done.stderr) == [progress_line(r, 2, k) for k, r in enumerate(records, 1)]
    assert "\r" not in done.stderr and "rollout" not in done.stderr and "it/s" not in done.stderr


def test_on_a_terminal_the_bar_runs_through_each_iteration_above_its_line(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    env = child_env()
    env.pop(PROGRESS_ENV, None)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal's size
    proc = subprocess.Popen(splitrl_cmd("train", "--run-dir", str(tmp_path / "run"), *CARTPOLE), env=env,
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    out, deadline = b"", time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the process closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=60) == 0, out.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(leader)
    text = out.decode(errors="replace")
    assert re.search(r"rollout: +\d+%.*step/s, link sent \d+\.\d\d MB recv", text), text[-3000:]
    assert re.search(r"train: +\d+%.*mb/s, link sent \d+\.\d\d MB recv", text), text[-3000:]
    records = _records(tmp_path / "run")
    lines = _iteration_lines(text.replace("\r", "\n"))
    assert lines == [progress_line(r, 2, k) for k, r in enumerate(records, 1)]


@pytest.fixture(autouse=True)
def _no_forced_bar(monkeypatch):
    """These tests say themselves where the bar is drawn."""
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
