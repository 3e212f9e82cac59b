"""benchmarks/compile_probe.py: each way of computing a part timed after a warm-up (the compile is the first call)."""

from __future__ import annotations

from benchmarks.compile_probe import thread_ms


def test_a_call_is_timed_after_three_to_warm_up():
    calls = []
    ms = thread_ms(lambda: calls.append(1), count=5)
    assert len(calls) == 3 + 5 and ms >= 0
