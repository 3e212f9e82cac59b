"""`splitrl bench lab`: the table from synthetic runs, and one real ``--quick`` run in the lab (root only)."""

import json

import pytest
from click.testing import CliRunner

from splitrl.bench.lab_bench import _with_speedups, auto_measure_bytes, lab_bench_table
from splitrl.cli.bench import bench

from ..netem.support import ip_netns_list, netns_usable

# Namespaces are the machine's: no other test worker makes any while this module runs (make test: several workers).
pytestmark = pytest.mark.usefixtures("netns_module")


def test_table_has_one_row_per_rate_and_config_with_speedups():
    def row(rate, bits, config, spi, nbytes):
        return {"rate": rate, "rate_bits": bits, "achieved_bits": 0.94 * bits, "achieved_ratio": 0.94,
                "config": config, "seconds_per_iteration": spi, "bytes_per_iteration": nbytes,
                "codec_args": [] if config == "fp32" else ["--codec-bwd", "ef:density=0.02,values=int8"],
                "ppo_args": ["--num-steps", "512"], "iterations": 2, "iterations_used": 1}

    rows = _with_speedups([row("5mbit", 5_000_000, "fp32", 60.0, 35e6), row("5mbit", 5_000_000, "codecs", 20.0, 2e6)])
    table = lab_bench_table(rows)
    assert "| rate | achieved Mbit/s | achieved/set | config | s/iteration | MB/iteration | x faster than fp32 |" in table
    assert "| 5 Mbit/s | 4.70 | 0.940 | fp32 | 60.0 | 35.00 | 1.00x |" in table
    assert "| 5 Mbit/s | 4.70 | 0.940 | codecs | 20.0 | 2.00 | 3.00x |" in table
    assert "`--codec-bwd ef:density=0.02,values=int8`" in table and "`--num-steps 512`" in table


def test_budget_rows_compare_with_the_fixed_codecs_and_list_each_choice():
    choice = {"iteration": 2, "spec/rollout": "int8", "spec/fwd": "int8", "spec/bwd": "ef:density=0.125,values=bf16",
              "spec/exchange": "features", "allowed_up_bytes": 3e6, "allowed_down_bytes": 3e6,
              "predicted_up_bytes": 2.9e6, "predicted_down_bytes": 1e6}
    rows = _with_speedups([
        {"rate": "2mbit", "rate_bits": 2_000_000, "achieved_bits": 1.9e6, "achieved_ratio": 0.95, "config": "fixed",
         "seconds_per_iteration": 80.0, "bytes_per_iteration": 18e6, "codec_args": ["--codec-fwd", "bf16"],
         "ppo_args": [], "iterations": 3, "iterations_used": 2, "budget": []},
        {"rate": "2mbit", "rate_bits": 2_000_000, "achieved_bits": 1.9e6, "achieved_ratio": 0.95, "config": "budget",
         "seconds_per_iteration": 40.0, "bytes_per_iteration": 8e6, "iterations": 3, "iterations_used": 2,
         "codec_args": ["--codec-fwd", "bf16", "--link-budget", "2mbit"], "ppo_args": [], "budget": [choice]},
    ])
    table = lab_bench_table(rows)
    assert "x faster than fixed |" in table and "| budget | 40.0 | 8.00 | 2.00x |" in table
    assert "- 2 Mbit/s budget, iteration 2: rollout int8, fwd int8, bwd ef:density=0.125,values=bf16" in table


def test_throughput_payload_follows_the_rate_within_bounds():
    mib = 1024 * 1024
    assert auto_measure_bytes(5_000_000) == 6 * mib
    assert auto_measure_bytes(20_000_000) == 24 * mib
    assert auto_measure_bytes(100_000_000) == 64 * mib
    assert auto_measure_bytes(100_000) == 4 * mib


def test_bad_rate_is_refused_before_any_lab():
    result = CliRunner().invoke(bench, ["lab", "--rates", "20mbit,fast"])
    assert result.exit_code == 2 and "fast" in result.output


# -- root and ip netns ---------------------------------------------------------------------------


def test_quick_run_in_the_lab(tmp_path):
    why_not = netns_usable()
    if why_not is not None:
        pytest.skip(f"lab bench: {why_not}")
    json_path = tmp_path / "rows.json"
    result = CliRunner().invoke(bench, ["lab", "--quick", "--out", str(tmp_path / "runs"), "--json", str(json_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads(json_path.read_text())
    assert [(r["rate"], r["config"]) for r in rows] == [("20mbit", "fp32"), ("20mbit", "codecs")]
    fp32, codecs = rows
    assert fp32["iterations"] == codecs["iterations"] == 2 and fp32["iterations_used"] == 1
    assert codecs["bytes_per_iteration"] < fp32["bytes_per_iteration"]
    assert 0.5 < fp32["achieved_ratio"] < 1.0  # tc counts headers: goodput stays below the set rate
    assert fp32["speedup_vs_fp32"] == 1.0 and codecs["speedup_vs_fp32"] > 0
    table = result.output
    assert "| 20 Mbit/s |" in table and "| fp32 |" in table and "| codecs |" in table
    for r in rows:
        assert (tmp_path / "runs" / f"20mbit-{r['config']}" / "stage0.log").exists()
    assert not [ns for ns in ip_netns_list() if ns.startswith("splitrl-")]
