"""benchmarks/training_turns.py: the training's parts in one process and in two that take turns at every minibatch
over a pipe and over splitrl's own link."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_times_the_same_parts_and_the_turns_are_what_is_left():
    out = subprocess.run([sys.executable, "benchmarks/training_turns.py", "--minibatches", "2", "--rounds", "1",
                          "--threads", "1", "--links", "pipe,splitrl"], capture_output=True, text=True, timeout=600,
                         check=True, cwd=ROOT).stdout
    rows = {line.split(" | ")[1]: line.rstrip(" |").split(" | ")[2:] for line in out.splitlines()
            if line.startswith("| 1 |")}
    assert set(rows) == {"one process", "two processes, a pipe", "two processes, splitrl's link"}
    for name, (encoder, heads, parts, cpu, turns, over, wall, faults) in rows.items():
        encoder, heads, parts, cpu, turns = map(float, (encoder, heads, parts, cpu, turns))
        assert min(encoder, heads) > 0  # each part timed on its side, the heads' across the link too
        assert abs(encoder + heads - parts) <= 0.02 and abs(cpu - parts - turns) <= 0.02  # (rounded)
        assert float(wall) > 0 and int(faults) >= 0
        # the other settings against the one process, in the same round
        assert (over == "") == (name == "one process")
        if over:
            assert abs(float(over) - (cpu - float(rows["one process"][3]))) <= 0.02


def test_an_unknown_link_is_refused_by_name():
    out = subprocess.run([sys.executable, "benchmarks/training_turns.py", "--links", "pipe,carrier-pigeon"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "--links: each of pipe, splitrl, got 'pipe,carrier-pigeon'" in out.stderr
