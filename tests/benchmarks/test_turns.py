"""benchmarks/turns.py: the rollout's parts in one process and in two that take turns over a pipe, a raw TCP
socket, raw ZeroMQ and splitrl's own links (ZeroMQ's and plain TCP's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_times_the_same_parts_and_the_turns_are_what_is_left():
    out = subprocess.run([sys.executable, "benchmarks/turns.py", "--steps", "4", "--rounds", "1",
                          "--links", "pipe,socket,zmq,splitrl,tcp"], capture_output=True, text=True, timeout=600,
                         check=True, cwd=ROOT).stdout
    rows = {line.split(" | ")[0][2:]: [float(cell) for cell in line.rstrip(" |").split(" | ")[1:]]
            for line in out.splitlines() if line.startswith("| one") or line.startswith("| two")}
    assert set(rows) == {"one process", "two processes, pipe", "two processes, socket", "two processes, zmq",
                         "two processes, splitrl", "two processes, tcp"}
    for env, encoder, heads, parts, cpu, turns, wall in rows.values():
        assert min(env, encoder, heads) > 0  # each part timed on its side, the heads' across the link too
        assert abs(env + encoder + heads - parts) <= 2 and abs(cpu - parts - turns) <= 2  # (rounded)
        assert wall > 0


def test_an_unknown_link_is_refused_by_name():
    out = subprocess.run([sys.executable, "benchmarks/turns.py", "--links", "pipe,carrier-pigeon"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "--links: each of pipe, socket, zmq, splitrl, tcp, got 'pipe,carrier-pigeon'" in out.stderr


def _edge_that_reports(link, peer, out):
    out.put("edge")


def _heads_that_dies(link, peer, out, report):
    raise SystemExit(3)


def test_a_side_that_dies_fails_the_setting_at_once():
    """Not after the minutes the other side would wait for it: a side's exit is noticed within about a second."""
    import time

    from benchmarks.turns import run_sides

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="a side exited with status 3"):
        run_sides(_edge_that_reports, _heads_that_dies, "zmq", ())
    assert time.monotonic() - start < 60
