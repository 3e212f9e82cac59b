"""The transport-swap benchmark in quick mode: the same training over every link, one table, one chart."""

from __future__ import annotations

import math

import pytest

from splitrl.bench.swap_bench import LINKS, format_swap_table, run_swap_bench, swap_chart, swap_targets
from splitrl.netem.netns import netns_available

# Namespaces are the machine's: no other test worker makes any while this module runs (make test: several workers).
pytestmark = pytest.mark.usefixtures("netns_module")


def test_quick_swap_runs_the_same_training_over_every_link(tmp_path) -> None:
    rows = run_swap_bench(iterations=2, quick=True, out_dir=str(tmp_path), timeout=300)
    assert [r["link"] for r in rows] == list(LINKS)
    for row in rows:
        assert row["iterations"] == 2 and row["measured_iterations"] == 1
        for key in ("steps_per_s", "seconds_per_iteration", "round_trips_per_s", "cpu_s_per_iteration",
                    "link_us_per_round_trip", "app_bytes_per_iteration"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["link"], key)
    # Same seed, schedule and frames: every link carries exactly the same bytes of ours.
    assert len({r["app_bytes_per_iteration"] for r in rows}) == 1
    assert len({r["app_bytes_total"] for r in rows}) == 1
    table = format_swap_table(rows).splitlines()
    assert len(table) == 2 + len(LINKS)
    assert next(line for line in table if line.startswith("| torch-rpc |")).split("|")[3].strip() == "1.00"
    png = swap_chart(rows, tmp_path / "swap.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "torch-rpc-0" / "metrics.jsonl").exists()

    if not netns_available():  # last, and said: the checks above ran
        pytest.skip("the kernel's byte counts need a network namespace (root, ip netns)")
    for row in rows:
        if row["endpoint"] == "ipc":
            assert row["kernel_bytes_total"] is None  # a Unix socket never reaches lo
        else:
            # TCP/IP headers and acks (and RPC's own envelope) come on top of our frames.
            assert row["kernel_bytes_total"] > row["app_bytes_total"]
    rpc = next(r for r in rows if r["link"] == "torch-rpc")
    zmq = next(r for r in rows if r["link"] == "zmq-tcp")
    assert rpc["kernel_bytes_total"] > zmq["kernel_bytes_total"]


def test_unknown_link_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown link"):
        run_swap_bench(["zmq-tcp", "carrier-pigeon"], quick=True)


def test_repeats_are_averaged_in_the_table() -> None:
    base = {"transport": "zmq", "endpoint": "tcp", "iterations": 3, "measured_iterations": 2,
            "seconds_per_iteration": 2.0, "round_trips_per_s": 100.0, "link_wait_per_iteration": 0.5,
            "link_us_per_round_trip": 50.0, "cpu_s_per_iteration": 3.0, "app_bytes_per_iteration": 2e6,
            "app_bytes_total": 6e6, "kernel_bytes_total": None, "run_dir": "x"}
    rows = [dict(base, link="zmq-tcp", steps_per_s=10.0, repeat=0), dict(base, link="torch-rpc", steps_per_s=4.0, repeat=0),
            dict(base, link="torch-rpc", steps_per_s=6.0, repeat=1), dict(base, link="zmq-tcp", steps_per_s=20.0, repeat=1)]
    table = format_swap_table(rows).splitlines()
    zmq = next(line for line in table if line.startswith("| zmq-tcp |")).split("|")
    assert zmq[2].strip() == "15.0" and zmq[3].strip() == "3.00"  # 15 steps/s against torch-rpc's 5
    assert "n/a" in zmq[-2]


def test_targets_read_the_micro_benchmark_rows() -> None:
    def row(transport: str, size: int, rtt: float, tput: float) -> dict:
        return {"transport": transport, "endpoint": "tcp", "size": size, "rtt_us_median": rtt, "throughput_MBps": tput}

    micro = [row("raw-zmq", 16384, 100.0, 800.0), row("zmq", 16384, 300.0, 300.0), row("torch-rpc", 16384, 3300.0, 5.0),
             row("raw-zmq", 1 << 20, 500.0, 3000.0), row("zmq", 1 << 20, 510.0, 2900.0)]
    lines = swap_targets(micro)
    assert "11.0x the rate" in lines[0] and lines[0].endswith("met)")
    assert "16384 B" in lines[1] and "missed" in lines[1]
    assert "1048576 B" in lines[2] and "throughput 0.97x" in lines[2] and lines[2].endswith("met)")
