"""The transport benchmark runs end to end in quick mode and reports complete, positive rows."""

from __future__ import annotations

import math

import pytest

from splitrl.bench.transport_bench import format_table, run_transport_bench

FIELDS = {"transport", "endpoint", "size", "throughput_MBps", "msgs_per_s", "rtt_us_median", "rtt_us_p99"}


def test_quick_run_has_every_combination_with_positive_numbers() -> None:
    rows = run_transport_bench(sizes=(16, 4096), quick=True)
    combos = {(r["transport"], r["endpoint"]) for r in rows}
    assert combos == {
        ("raw-zmq", "tcp"), ("raw-zmq", "ipc"), ("raw-zmq", "inproc"),
        ("raw-torch", "tcp"), ("raw-torch", "ipc"), ("raw-torch", "inproc"),
        ("zmq", "tcp"), ("zmq", "ipc"), ("zmq", "inproc"),
        ("tcp", "tcp"), ("torch-rpc", "tcp"),
    }  # fmt: skip
    assert len(rows) == 2 * len(combos)
    for row in rows:
        assert set(row) == FIELDS
        assert row["size"] in (16, 4096)
        for key in ("throughput_MBps", "msgs_per_s", "rtt_us_median", "rtt_us_p99"):
            assert math.isfinite(row[key]) and row[key] > 0, (row, key)
        assert row["rtt_us_p99"] >= row["rtt_us_median"]
        assert row["throughput_MBps"] == pytest.approx(row["msgs_per_s"] * row["size"] / 1e6)

    table = format_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert all(line.count("|") == 10 for line in table)
    raw_lines = [line for line in table if "| raw-zmq |" in line]
    assert raw_lines and all(line.endswith("| 1.00 | 1.00 |") for line in raw_lines)


def test_format_table_without_baseline_shows_dashes() -> None:
    row = {"transport": "tcp", "endpoint": "tcp", "size": 1 << 20, "throughput_MBps": 1000.0,
           "msgs_per_s": 953.7, "rtt_us_median": 900.0, "rtt_us_p99": 1500.0}  # fmt: skip
    line = format_table([row]).splitlines()[-1]
    assert line.startswith("| 1 MiB | tcp | tcp | 1000.0 |") and line.endswith("| - | - |")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sizes": (15,)},
        {"sizes": ()},
        {"transports": ("carrier-pigeon",)},
        {"endpoints": ("udp",)},
        {"transports": ("tcp",), "endpoints": ("ipc",)},
        {"seconds": 0},
        {"rounds": 0},
    ],
)
def test_bad_arguments_are_value_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        run_transport_bench(**kwargs)
