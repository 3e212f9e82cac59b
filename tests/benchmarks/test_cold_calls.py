"""benchmarks/cold_calls.py, cold_checks.py and rollout_store.py: each call timed after a pause and back to back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.cold_calls import timed


def test_a_call_is_timed_cold_and_warm():
    calls = []
    cold, warm = timed(lambda: calls.append(1), count=3, pause_s=0.001)
    assert len(calls) == 3 + 3 + 30  # cold, a warm-up, then the warm loop
    assert cold >= 0 and warm >= 0


def test_the_script_prints_a_row_for_each_call():
    out = subprocess.run([sys.executable, "benchmarks/cold_calls.py", "--count", "2", "--pause-ms", "0.1"],
                         capture_output=True, text=True, timeout=300, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| call")]
    assert [row.split(" | ")[0] for row in rows] == ["| torch.frombuffer, 16 KiB", "| wire decode of a step",
                                                     "| heads' acting forward and draw (a part)",
                                                     "| Learner.act (the part and its bookkeeping)",
                                                     "| encoder's acting forward (a part)",
                                                     "| Edge.observe (the part and its bookkeeping)"]
    assert all(row.split(" | ")[3].endswith("x") for row in rows)
    calls = {row.split(" | ")[0][2:]: int(row.split(" | ")[4].rstrip(" |")) for row in rows}
    # The part's own calls are among Learner.act's, and its bookkeeping adds some
    assert 0 < calls["heads' acting forward and draw (a part)"] < calls["Learner.act (the part and its bookkeeping)"]
    assert 0 < calls["encoder's acting forward (a part)"] < calls["Edge.observe (the part and its bookkeeping)"]


def test_torch_calls_counts_each_operator_a_call_dispatches():
    import torch

    from benchmarks.cold_calls import torch_calls

    x = torch.ones(3)
    assert torch_calls(lambda: (x + 1) * 2) == 2 and torch_calls(lambda: None) == 0


def test_the_rollout_storage_benchmark_times_both_ways_each_round():
    out = subprocess.run([sys.executable, "benchmarks/rollout_store.py", "--count", "2", "--rounds", "2"],
                         capture_output=True, text=True, timeout=300, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    rows = [line.split(" | ")[:2] for line in out.splitlines() if line.startswith("| ") and "round" not in line]
    assert rows == [["| 1", "through index tensors"], ["| 1", "as a slice"], ["| 2", "through index tensors"],
                    ["| 2", "as a slice"]]


def test_the_checks_are_timed_both_ways_in_every_round():
    out = subprocess.run([sys.executable, "benchmarks/cold_checks.py", "--count", "2", "--rounds", "2",
                          "--pause-ms", "0.1"], capture_output=True, text=True, timeout=300, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and not line.startswith("| way")]
    assert [row[0] for row in rows] == ["| torch's reductions and the mask (before)", "| numpy's (now)"]
    for _, cold, warm in rows:
        assert len(cold.split(", ")) == len(warm.rstrip(" |").split(", ")) == 2
        assert all(float(value) > 0 for value in cold.split(", "))
