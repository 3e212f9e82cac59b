"""benchmarks/turns.py: the rollout's parts in one process and in two that take turns through a pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_both_settings_time_the_same_parts_and_the_turns_are_what_is_left():
    out = subprocess.run([sys.executable, "benchmarks/turns.py", "--steps", "4", "--rounds", "1"],
                         capture_output=True, text=True, timeout=600, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    rows = {line.split(" | ")[0][2:]: [float(cell) for cell in line.rstrip(" |").split(" | ")[1:]]
            for line in out.splitlines() if line.startswith("| one") or line.startswith("| two")}
    assert set(rows) == {"one process", "two processes"}
    for env, encoder, heads, parts, cpu, turns, wall in rows.values():
        assert min(env, encoder, heads) > 0  # each part timed on its side, the heads' across the pipe too
        assert abs(env + encoder + heads - parts) <= 2 and abs(cpu - parts - turns) <= 2  # (rounded)
        assert wall > 0
