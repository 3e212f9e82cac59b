"""benchmarks/tax_table.py: each process's CPU against the parts that are its own, the twin's counted once."""

from __future__ import annotations

import json

import pytest

from benchmarks.tax_table import rows


def _run(path, stage0, stage1, envs=0.0, twin=False):
    path.mkdir()
    for name in ["config.json"] if twin else ["config-stage0.json", "config-stage1.json"]:
        (path / name).write_text('{"settings": {}}')
    records = [{"iteration": i, "global_step": 4096 * i, "time/iteration": 50.0, "charts/SPS": 80.0,
                "cpu/stage0": stage0, "cpu/stage1": stage1, "cpu/envs": envs} for i in (1, 2, 3)]
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
