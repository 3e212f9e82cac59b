"""benchmarks/step_instructions.py: the calls it counts under valgrind are built from the stages' classes and run
(valgrind itself takes minutes: the counting is the benchmark's, not a test's)."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_call_it_counts_runs_here():
    spec = importlib.util.spec_from_file_location("step_instructions", ROOT / "benchmarks" / "step_instructions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.ExitStack() as opened:  # the env and the links, closed
        calls = module._calls(opened)
        names = [name for name, _ in calls]
        assert len(set(names)) == len(names) == 8
        assert any("splitrl's link" in name for name in names) and any("raw ZeroMQ" in name for name in names)
        for _, call in calls:
            for _ in range(2):
                call()
