"""`splitrl run`: the one-command local launcher starts both stages and always stops both."""

import json
import signal
import subprocess
import time

import pytest

from ..conftest import TINY


def _leftovers(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_launcher_runs_a_split_training_to_the_end(tmp_path, spawn):
    proc = spawn("run", "--run-dir", str(tmp_path / "run"), *TINY)
    code, out = proc.finish(timeout=240)
    assert code == 0, out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[-1]["net_total/train_fwd/sent_bytes"] > 0
    assert not _leftovers(str(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_stops_both_stages(tmp_path, spawn, sig):
    run_dir = tmp_path / "run"
    proc = spawn("run", "--run-dir", str(run_dir), "--total-steps", "100000", "--num-steps", "4096", "--threads", "1")
    proc.wait_for("stage0 connected", timeout=120)
    time.sleep(1)
    proc.popen.send_signal(sig)
    code, out = proc.finish(timeout=60)
    assert code != 0
    assert "stopping both stages" in out
    assert "stage0 stopped" in out or "interrupted" in out
    assert not _leftovers(str(run_dir))


def test_curve_prints_one_row_per_iteration(tmp_path):
    from splitrl.stages.curve import curve_table

    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"iteration": 1, "global_step": 4096, "charts/episodic_return_ema": -40.0, "charts/episodic_return": -41.5,
         "charts/episodes": 4, "charts/SPS": 50.0, "net_total/step/sent_bytes": 2_000_000,
         "net_total/action/recv_bytes": 1_000_000},
        {"iteration": 2, "global_step": 8192, "charts/episodic_return_ema": None, "charts/episodic_return": None,
         "charts/episodes": 0, "charts/SPS": 60.0, "net_total/step/sent_bytes": 4_000_000,
         "net_total/action/recv_bytes": 2_000_000},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = curve_table(run).splitlines()
    assert lines[2] == "| 1 | 4096 | -40.0 | -41.5 | 4 | 50.0 | 3 |"
    assert lines[3] == "| 2 | 8192 | - | - | 0 | 60.0 | 6 |"
