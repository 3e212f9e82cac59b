"""`splitrl run`: the one-command local launcher starts both stages and always stops both."""

import json
import os
import signal
import subprocess
import time

import pytest

from ..conftest import TINY


def _leftovers(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_launcher_runs_a_split_training_to_the_end(tmp_path, spawn):
    proc = spawn("run", "--run-dir", str(tmp_path / "run"), *TINY, cold=True)  # as from a shell; `_leftovers` as below
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
                 "--hidden", "32", *MODES[mode], cold=True)  # its stages carry its command line: `_leftovers` finds them
    proc.wait_for("stage0 connected", timeout=120)
    time.sleep(1)
    proc.popen.send_signal(sig)
    code, out = proc.finish(timeout=60)
    assert code != 0
    assert "stopping both stages" in out
    assert "stage0 stopped" in out or "interrupted" in out
    assert not _leftovers(str(run_dir))


@pytest.mark.parametrize("mode", ["sync", "pipelined", "async"])
def test_ctrl_c_in_a_terminal_stops_both_stages_once_and_cleanly(tmp_path, mode):
    """A terminal's Ctrl-C reaches the launcher and both stages at once, and the launcher then sends each stage
    SIGTERM: the stages take the two as one (no traceback from a cleanup cut short) and exit 130."""
    from ..conftest import child_env, splitrl_cmd
    from .test_failures import MODES

    run_dir = tmp_path / "run"
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(splitrl_cmd("run", "--run-dir", str(run_dir), "--total-steps", "491520",
                                             "--num-steps", "4096", "--threads", "1", "--hidden", "32", *MODES[mode]),
                                 env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "stage0 connected" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # into the rollout
        os.killpg(popen.pid, signal.SIGINT)  # the whole foreground group, as a terminal does
        popen.wait(timeout=60)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=10)
    text = log.read_text()
    assert "stopping both stages" in text and "(stage1 exit 130, stage0 exit 130)" in text, text
    assert "Traceback" not in text and "Exception ignored" not in text, text
    assert not _leftovers(str(run_dir))
