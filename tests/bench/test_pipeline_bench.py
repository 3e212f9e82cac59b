"""`splitrl bench pipeline`: its rows come from the run directories, steady state only, side by side."""

import json

import pytest

from splitrl.bench.pipeline_bench import MODES, _summary, pipeline_table, run_pipeline_bench

from ..conftest import splitrl_here


def _run(path, times, cpu0, cpu1, staleness=None, envs=None):
    path.mkdir(parents=True)
    records = []
    for i, t in enumerate(times, 1):
        r = {"iteration": i, "global_step": 4096 * i, "time/iteration": t, "charts/SPS": 4096 / t,
             "cpu/stage0": cpu0 * t, "cpu/stage1": cpu1 * t, "time/link_wait": 1.0, "net/step/sent_bytes": 100,
             "net_total/step/sent_bytes": 100 * i, "link/rtt_ms": 0.3}
        if envs is not None:
            r["cpu/envs"] = envs * t
        if staleness is not None:
            r.update({"async/staleness_mean": staleness, "async/staleness_max": 1.0})
        records.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_rows_are_the_steady_state_and_the_table_compares_side_by_side(tmp_path):
    sync = _summary("sync", 0.0, _run(tmp_path / "sync", [130.0, 100.0, 100.0], 0.9, 0.3))
    fast = _summary("+ async", 0.0, _run(tmp_path / "async", [80.0, 50.0, 30.0], 1.0, 0.8, staleness=0.5, envs=0.4))
    slow = _summary("+ async", 20.0, _run(tmp_path / "async20", [80.0, 55.0, 30.0], 0.9, 0.7, staleness=0.5))
    assert fast["seconds_per_iteration"] == 50.0  # not the last, which trained with no rollout beside it
    assert fast["busy_stage0"] == pytest.approx(1.0) and fast["busy_stage1"] == pytest.approx(0.8)
    assert fast["busy_envs"] == pytest.approx(0.4) and fast["cpu_per_iteration"] == pytest.approx(50 * 2.2)
    assert sync["busy_envs"] is None and sync["cpu_per_iteration"] is None  # a run from before cpu/envs
    assert fast["staleness_mean"] == 0.5 and fast["staleness_max"] == 1.0 and sync["staleness_max"] == 0.0
    table = pipeline_table([sync, fast, slow])
    lines = table.splitlines()
    assert len(lines) == 5
    assert "| 0 ms | + async | 50.0 | 81.9 | 2.00 |" in lines[3]  # steps/s over the synchronous run's
    assert "1.10x" in lines[4]  # its own 0 ms time, 55 / 50
    assert "| 0.40 | 110.0 |" in lines[3] and "| 0.30 |  |  |" in lines[2]  # busy envs, CPU s; blank before


def test_unknown_modes_are_refused_before_anything_runs(tmp_path):
    assert "sync" in MODES and "+ async" in MODES
    with pytest.raises(ValueError, match="unknown mode"):
        run_pipeline_bench(["sync", "turbo"], [0.0], out_dir=str(tmp_path))


def test_with_a_floor_each_row_says_how_far_it_is_from_it(tmp_path):
    fast = _summary("+ async", 0.0, _run(tmp_path / "async", [80.0, 50.0, 30.0], 1.0, 0.8, envs=0.4))
    floor = {"floor": 40.0, "total": 80.0}
    line = pipeline_table([fast], floor).splitlines()[2]
    assert line.endswith(" 1.25x | +30.0 |")  # 50 s over 40 s; 110 CPU s an iteration, 80 in the parts
    assert pipeline_table([fast]).splitlines()[0].count("|") + 2 == pipeline_table([fast], floor).splitlines()[0].count("|")
    # Rows run with --channels-last are over the floor of the default's parts and over their own parts' CPU
    assert pipeline_table([fast], floor, {"floor": 35.0, "total": 70.0}).splitlines()[2].endswith(" 1.25x | +40.0 |")


def test_the_faster_parts_options_are_read_from_the_extra_arguments_before_any_run():
    from splitrl.cli.bench import _faster_parts

    assert _faster_parts(("--rollout-groups", "2", "--channels-last")) == (False, True)
    assert _faster_parts(("--fused-adam", "--threads", "1")) == (True, False)
    assert _faster_parts(()) == (False, False)
    bad = splitrl_here("bench", "pipeline", "--modes", "sync", "--rtt", "0", "--", "--chanels-last", code=None)
    assert bad.exit_code != 0 and "--chanels-last" in bad.output
