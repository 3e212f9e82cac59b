"""benchmarks/tax_table.py: each process's CPU against the parts that are its own, the twin's counted once."""

from __future__ import annotations

import json

import pytest

from benchmarks.tax_table import rows


def _run(path, stage0, stage1, envs=0.0, twin=False, iterations=3, vary=0.0):
    """A run's records: ``iterations`` of them, the ``i``-th's CPU and seconds ``(i - 2) * vary`` off the given."""
    path.mkdir()
    for name in ["config.json"] if twin else ["config-stage0.json", "config-stage1.json"]:
        (path / name).write_text('{"settings": {}}')
    records = [{"iteration": i, "global_step": 4096 * i, "time/iteration": 50.0 + (i - 2) * vary, "charts/SPS": 80.0,
                "cpu/stage0": stage0 + (i - 2) * vary, "cpu/stage1": stage1, "cpu/envs": envs}
               for i in range(1, iterations + 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_each_process_is_set_against_its_own_parts_and_the_twin_is_one_process(tmp_path):
    parts = {"envs": 20.0, "encoder acting": 3.0, "heads acting": 5.0, "encoder training": 30.0,
             "heads training": 15.0}
    floor = {"parts": parts, "total": 73.0, "floor": 36.5}
    own = {"parts": dict(parts, **{"encoder training": 32.0}), "total": 75.0, "floor": 37.5}
    bench = [{"mode": "twin", "seconds_per_iteration": 50.0, "run_dir": _run(tmp_path / "twin", 90.0, 90.0, twin=True),
              "floor": floor, "parts": own},
             {"mode": "sync --threads 1", "seconds_per_iteration": 60.0, "run_dir": _run(tmp_path / "s", 60.0, 25.0),
              "floor": floor}]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    twin, sync = rows(tmp_path / "bench.json")
    cells = [cell.strip() for cell in twin.split("|")[1:-1]]
    assert cells[3] == "90.0 (+15.0 over 75.0)" and cells[4] == "" and cells[6] == "90.0"  # once, not 180
    assert cells[7] == "1.20x (of 75.0)" and cells[8] == "1.23x (of 73.0)"  # its own parts, and the floor's
    cells = [cell.strip() for cell in sync.split("|")[1:-1]]
    assert cells[3] == "60.0 (+7.0 over 53.0)" and cells[4] == "25.0 (+5.0 over 20.0)"
    assert cells[7] == cells[8] == "1.16x (of 73.0)" and cells[2] == f"{60 / 36.5:.2f}x"
    assert float(cells[6]) == pytest.approx(85.0)


def test_the_range_over_the_iterations_used_is_given_beside_their_mean(tmp_path):
    parts = {"envs": 20.0, "encoder acting": 3.0, "heads acting": 5.0, "encoder training": 30.0,
             "heads training": 15.0}
    floor = {"parts": parts, "total": 73.0, "floor": 36.5}
    # Five iterations, each 2 s and 2 CPU-s more than the one before: the first and the last are left out.
    bench = [{"mode": "sync", "seconds_per_iteration": 52.0, "floor": floor,
              "run_dir": _run(tmp_path / "s", 60.0, 13.0, iterations=5, vary=2.0)},
             {"mode": "sync", "seconds_per_iteration": 50.0, "floor": floor,
              "run_dir": _run(tmp_path / "one", 60.0, 13.0)}]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    five, one = rows(tmp_path / "bench.json")
    cells = [cell.strip() for cell in five.split("|")[1:-1]]
    assert cells[6] == "75.0" and cells[7] == "1.03x (of 73.0)"  # the mean of iterations 2-4: 73, 75, 77
    assert cells[9] == "50.0-54.0" and cells[10] == f"{73 / 73:.2f}-{77 / 73:.2f}x"
    cells = [cell.strip() for cell in one.split("|")[1:-1]]
    assert cells[9] == "50.0" and cells[10] == "1.00x"  # one iteration used: its figure alone


def test_a_clone_reads_the_records_kept_beside_the_json(tmp_path):
    parts = {"envs": 20.0, "encoder acting": 3.0, "heads acting": 5.0, "encoder training": 30.0,
             "heads training": 15.0}
    floor = {"parts": parts, "total": 73.0, "floor": 36.5}
    (tmp_path / "bench").mkdir()
    _run(tmp_path / "bench" / "0ms-sync", 60.0, 13.0)  # as `scripts/keep_run.sh` keeps it, beside bench.json
    bench = [{"mode": "sync", "seconds_per_iteration": 50.0, "floor": floor,
              "run_dir": str(tmp_path / "gone" / "0ms-sync")}]  # where the bench wrote it: not in a clone
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (row,) = rows(tmp_path / "bench.json")
    assert row.split(" | ")[6] == "73.0"
    (tmp_path / "gone" / "0ms-sync").parent.mkdir()
    _run(tmp_path / "gone" / "0ms-sync", 70.0, 13.0)  # the bench's own directory, where it is there, first
    (row,) = rows(tmp_path / "bench.json")
    assert row.split(" | ")[6] == "83.0"


def test_the_row_is_also_set_against_each_timing_of_its_parts(tmp_path):
    parts = {"envs": 20.0, "encoder acting": 3.0, "heads acting": 5.0, "encoder training": 30.0,
             "heads training": 15.0}
    # Timed at 70 right before the row and 76 right after: the mean, 73, is what "x parts" takes.
    beside = {"parts": parts, "total": 73.0, "floor": 36.5, "bracket": [70.0, 76.0]}
    bench = [{"mode": "sync", "seconds_per_iteration": 50.0, "floor": beside,
              "run_dir": _run(tmp_path / "s", 60.0, 17.0)},
             {"mode": "sync", "seconds_per_iteration": 50.0, "floor": dict(beside, bracket=[]),
              "run_dir": _run(tmp_path / "once", 60.0, 17.0)}]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    with_bracket, once = rows(tmp_path / "bench.json")
    cells = [cell.strip() for cell in with_bracket.split("|")[1:-1]]
    assert cells[7] == "1.05x (of 73.0)" and cells[11] == f"{77 / 70:.2f}x, {77 / 76:.2f}x"
    assert [cell.strip() for cell in once.split("|")[1:-1]][11] == ""
