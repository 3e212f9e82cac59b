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


@pytest.mark.parametrize("mode, sig", [("sync", signal.SIGINT), ("sync", signal.SIGTERM),
                                       ("pipelined", signal.SIGINT), ("async", signal.SIGINT),
                                       ("async-epoch", signal.SIGINT)])
def test_interrupting_the_launcher_stops_both_stages(tmp_path, spawn, mode, sig):
    from .test_failures import MODES

    run_dir = tmp_path / "run"
    proc = spawn("run", "--run-dir", str(run_dir), "--total-steps", "491520", "--num-steps", "4096", "--threads", "1",
                 *MODES[mode])
    proc.wait_for("stage0 connected", timeout=120)
    time.sleep(1)
    proc.popen.send_signal(sig)
    code, out = proc.finish(timeout=60)
    assert code != 0
    assert "stopping both stages" in out
    assert "stage0 stopped" in out or "interrupted" in out
    assert not _leftovers(str(run_dir))
