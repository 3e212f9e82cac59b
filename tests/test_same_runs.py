"""scripts/same_runs.py --records: a run trained again, held against the records committed of it (no
checkpoints): every metric but the machine's, and every training episode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .conftest import ROOT, script

RECORDS = ROOT / "docs" / "results" / "learned-spread" / "seed2-lr1e-4-floor-0.8"


def _copy(tmp_path: Path) -> Path:
    run = tmp_path / "again"
    run.mkdir()
    for name in ("metrics.jsonl", "episodes.jsonl"):
        shutil.copy(RECORDS / name, run / name)
    return run


def _rewrite(path: Path, line: int, change) -> None:
    rows = path.read_text().splitlines()
    row = json.loads(rows[line])
    change(row)
    rows[line] = json.dumps(row)
    path.write_text("\n".join(rows) + "\n")


def test_records_alone_are_compared_and_the_machines_figures_are_not(tmp_path):
    run = _copy(tmp_path)
    _rewrite(run / "metrics.jsonl", 5, lambda r: r.update({"time/iteration": 1.0, "cpu/stage0": 2.0,
                                                           "charts/SPS": 3}))
    found, compared = script("same_runs").differences(run, RECORDS, records=True)
    assert found == [] and compared == 414


def test_an_episode_or_a_metric_that_differs_is_named(tmp_path):
    run = _copy(tmp_path)
    _rewrite(run / "episodes.jsonl", 277, lambda r: r.update({"return": r["return"] + 1e-9}))
    _rewrite(run / "metrics.jsonl", 41, lambda r: r.update({"losses/value_loss": r["losses/value_loss"] * 2}))
    found, _ = script("same_runs").differences(run, RECORDS, records=True)
    assert found == ["episodes: 414 against 414, the first difference at line 278",
                     "metrics of iteration 42: losses/value_loss"]
