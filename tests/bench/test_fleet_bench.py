"""`splitrl bench fleet`: real edges on loopback; its rows come from every edge's run directory."""

import pytest

from splitrl.bench.fleet_bench import fleet_rows, fleet_table, run_fleet_bench

TINY_RUN = ["--epochs", "2", "--minibatches", "2", "--max-episode-steps", "20"]


def test_a_quick_fleet_bench_has_a_row_per_edge_count_with_every_edge(tmp_path):
    rows = run_fleet_bench([1, 2], iterations=2, num_steps=32, extra_args=TINY_RUN, out_dir=str(tmp_path),
                           timeout=300, echo=lambda line: None)
    assert [r["edges"] for r in rows] == [1, 2]
    one, two = rows
    assert len(two["busy_edges"]) == 2 and len(two["bytes_per_iteration_per_edge"]) == 2
    assert all(b > 0 for r in rows for b in r["bytes_per_iteration_per_edge"])
    assert all(0 < b < 2 for r in rows for b in [r["busy_stage1"], *r["busy_edges"]])
    # the fleet's samples an iteration are both edges': 64, in the seconds the iteration took
    assert two["samples_per_second"] * two["seconds_per_iteration"] == pytest.approx(64, rel=0.05)
    assert one["samples_per_second"] * one["seconds_per_iteration"] == pytest.approx(32, rel=0.05)
    table = fleet_table(rows).splitlines()
    assert len(table) == 4 and table[2].startswith("| 1 | ") and " 1.00 |" in table[2]
    assert fleet_rows(tmp_path, [1, 2, 4]) == rows  # the 4-edge run is not there: no row


def test_a_quick_capacity_bench_replays_real_step_messages_against_a_real_stage1(tmp_path):
    """Fake edges replay step messages an Edge made (CarRacing, fp32 features): stage1 accepts every one (a
    refused message fails the replaying process), answers both edges, in lock step and as they come, and the
    figures are of the window."""
    import json

    from splitrl.bench.capacity_bench import capacity_table, run_capacity_bench

    rows = run_capacity_bench([1, 2], seconds=1.0, warmup=0.3, out_dir=str(tmp_path), echo=lambda line: None,
                              act_waits=["all", "1"])
    assert [(r["act_wait"], r["edges"]) for r in rows] == [("all", 1), ("all", 2), ("1", 1), ("1", 2)]
    for r in rows:
        assert r["requests"] > 10 and r["requests_per_second"] == pytest.approx(r["requests"] / 1.0)
        assert 0 < r["rtt_p50_ms"] <= r["rtt_p99_ms"]
        assert 0 < r["busy_stage1"] < 1.5 and 0 < r["busy_edges"] < 1.5
        assert r["payload_bytes"] >= 4096 * 4  # the paper's features in float32, and the outcome
    assert json.loads((tmp_path / "capacity.json").read_text()) == rows
    table = capacity_table(rows).splitlines()
    assert table[2].startswith("| all | 1 | ") and table[5].startswith("| 1 ms | 2 | ")
