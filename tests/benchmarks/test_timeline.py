"""A traced split run writes each stage's phases on one time axis, and benchmarks/timeline.py accounts for them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.timeline import account, draw, load

TINY = ["--total-steps", "128", "--num-steps", "32", "--epochs", "2", "--minibatches", "2", "--max-episode-steps", "20",
        "--threads", "1", "--checkpoint-every", "0", "--vector", "sync", "--num-envs", "2", "--rollout-groups", "2",
        "--microbatches", "2", "--part-workers", "2"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("timeline")
    env = dict(os.environ, SPLITRL_TIMELINE=str(root / "spans"), SPLITRL_PROGRESS="0")
    subprocess.run([sys.executable, "-m", "splitrl", "run", "--run-dir", str(root / "run"), *TINY], env=env,
                   check=True, timeout=240, capture_output=True)
    return root / "spans"


def test_each_stage_writes_its_own_spans_and_the_accounting_fills_the_window(traced: Path, tmp_path: Path):
    assert len(list(traced.glob("timeline-*.jsonl"))) == 2  # one file a stage process, the launcher none
    window, rows = load(traced, 2)
    by_row = {r["row"]: r for r in account(window, rows)}
    # Each stage's own thread, and the workers that take its micro-batches at once (`splitrl.schedule.workers`).
    assert {"stage0", "stage1"} <= set(by_row)
    assert all(row.startswith(("stage0, thread parts", "stage1, thread parts"))
               for row in set(by_row) - {"stage0", "stage1"})
    assert {"env", "encoder", "link"} <= set(by_row["stage0"]["phases"])
    assert set(by_row["stage1"]["phases"]) == {"heads"}
    for r in by_row.values():  # a thread's phases do not overlap: with the rest they make the window
        assert sum(r["phases"].values()) + r["in no phase"] == pytest.approx(window[1] - window[0], abs=1e-6)
        assert r["in no phase"] >= 0
    assert by_row["stage1"]["phases"]["heads"] > 0
    workers = [r for name, r in by_row.items() if ", thread parts" in name]
    assert {"encoder", "heads"} == {phase for r in workers for phase in r["phases"]}
    draw(window, rows, tmp_path / "t.png", "t")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_the_twins_stages_are_its_threads(tmp_path: Path):
    """Both stages in one process: each flush takes what both threads ended, the window still puts them in place."""
    env = dict(os.environ, SPLITRL_TIMELINE=str(tmp_path / "spans"), SPLITRL_PROGRESS="0")
    subprocess.run([sys.executable, "-m", "splitrl", "train", "--run-dir", str(tmp_path / "run"), *TINY[:12]], env=env,
                   check=True, timeout=240, capture_output=True)
    window, rows = load(tmp_path / "spans", 2)
    by_row = {r["row"]: r for r in account(window, rows)}
    by_row = {k: v for k, v in by_row.items() if ", thread parts" not in k}  # the micro-batches' workers
    assert set(by_row) == {"twin", "twin, thread stage1"}
    assert {"env", "encoder", "link"} <= set(by_row["twin"]["phases"])
    assert set(by_row["twin, thread stage1"]["phases"]) == {"heads"}
    assert sum(by_row["twin"]["phases"].values()) == pytest.approx(window[1] - window[0], rel=0.2)


def test_no_spans_are_kept_without_the_variable():
    code = ("from splitrl.schedule.common import TIMELINE, PhaseClock\nc = PhaseClock()\nwith c('x'): pass\n"
            "print(TIMELINE.directory, len(TIMELINE.spans))")
    env = {k: v for k, v in os.environ.items() if k != "SPLITRL_TIMELINE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.split() == ["None", "0"]
