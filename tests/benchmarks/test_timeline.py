"""A traced split run writes each stage's phases on one time axis, and benchmarks/timeline.py accounts for them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.timeline import STRETCH_PARTS, account, cpu_account, cpu_table, draw, load

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


def test_a_pipelined_runs_stretches_are_its_rollout_and_training(traced: Path):
    """The pipelined schedule marks the same stretches as the synchronous one, inside stage0's iteration."""
    window, _ = load(traced, 2)
    rows = {r["process"]: r for r in cpu_account(traced, 2)}
    assert set(rows) == {"stage0", "stage1"}
    for r in rows.values():
        assert [st["stretch"] for st in r["stretches"]] == ["rollout", "training"]
        assert all(st["cpu"] > 0 and st["wall"] > 0 and "parts" not in st for st in r["stretches"])
    assert sum(st["wall"] for st in rows["stage0"]["stretches"]) <= window[1] - window[0] + 1e-6


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
    # Its CPU account: one process, each stretch once (both threads mark it), against both stages' parts.
    floor = {"parts": {"envs": 1.0, "encoder acting": 0.5, "heads acting": 0.25, "encoder training": 2.0,
                       "heads training": 4.0}}
    (twin,) = cpu_account(tmp_path / "spans", 2, floor)
    assert twin["process"] == "twin"
    assert [st["stretch"] for st in twin["stretches"]] == ["rollout", "training"]
    assert [st["parts"] for st in twin["stretches"]] == [1.75, 6.0]
    assert {"env", "encoder", "heads"} <= set(twin["stretches"][0]["phases"])
    assert 0 < sum(st["cpu"] for st in twin["stretches"]) <= twin["cpu"] + 0.02


def test_no_spans_are_kept_without_the_variable():
    code = ("from splitrl.schedule.common import TIMELINE, PhaseClock\nc = PhaseClock()\nwith c('x'): pass\n"
            "print(TIMELINE.directory, len(TIMELINE.spans))")
    env = {k: v for k, v in os.environ.items() if k != "SPLITRL_TIMELINE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.split() == ["None", "0"]


def test_a_synchronous_runs_stretches_carry_each_process_cpu_and_set_it_against_the_parts(tmp_path: Path):
    """The synchronous schedule marks each stage's rollout and training: their process CPU seconds hold their
    phases' thread CPU seconds, and a floor's parts are set against the stretch that runs them."""
    env = dict(os.environ, SPLITRL_TIMELINE=str(tmp_path / "spans"), SPLITRL_PROGRESS="0")
    subprocess.run([sys.executable, "-m", "splitrl", "run", "--run-dir", str(tmp_path / "run"), *TINY[:12]], env=env,
                   check=True, timeout=240, capture_output=True)
    floor = {"parts": {"envs": 1.0, "encoder acting": 0.5, "heads acting": 0.25, "encoder training": 2.0,
                       "heads training": 4.0}}
    rows = {r["process"]: r for r in cpu_account(tmp_path / "spans", 2, floor)}
    assert set(rows) == {"stage0", "stage1"}
    for role, r in rows.items():
        assert [st["stretch"] for st in r["stretches"]] == ["rollout", "training"]
        for st in r["stretches"]:
            assert st["cpu"] > 0 and st["wall"] > 0
            # a phase's thread CPU is part of its process's; the clocks tick in steps of a few milliseconds
            assert sum(st["phases"].values()) <= st["cpu"] + 0.02
            assert st["around"] == pytest.approx(st["cpu"] - sum(st["phases"].values()))
            assert st["parts"] == sum(floor["parts"][p] for p in STRETCH_PARTS[(role, st["stretch"])])
        assert sum(st["cpu"] for st in r["stretches"]) <= r["cpu"] + 0.02
    assert {"env", "encoder"} <= set(rows["stage0"]["stretches"][0]["phases"])
    assert set(rows["stage1"]["stretches"][1]["phases"]) == {"heads"}
    table = cpu_table(list(rows.values()))
    assert "| stage1 | training |" in table and "x) |" in table
    out = subprocess.run([sys.executable, "benchmarks/timeline.py", str(tmp_path / "spans"), "--iteration", "2",
                          "--cpu"], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert "| stage0 | rollout |" in out and "| stage1 | **iteration** |" in out
