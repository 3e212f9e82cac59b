"""`splitrl bench pipeline`: its rows come from the run directories, steady state only, side by side."""

import json
from pathlib import Path

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
    assert not list(tmp_path.iterdir())


def test_with_a_floor_each_row_says_how_far_it_is_from_it(tmp_path):
    fast = _summary("+ async", 0.0, _run(tmp_path / "async", [80.0, 50.0, 30.0], 1.0, 0.8, envs=0.4))
    floor = {"floor": 40.0, "total": 80.0}
    line = pipeline_table([fast], floor).splitlines()[2]
    assert line.endswith(" 1.25x | +30.0 | 1.38x |")  # 50 s over 40 s; 110 CPU s an iteration, 80 in the parts
    assert pipeline_table([fast]).splitlines()[0].count("|") + 3 == pipeline_table([fast], floor).splitlines()[0].count("|")
    # Rows run with --channels-last are over the floor of the default's parts and over their own parts' CPU
    own = {"floor": 35.0, "total": 100.0}
    assert pipeline_table([fast], floor, own).splitlines()[2].endswith(" 1.25x | +10.0 | 1.10x |")
    # and a row's own parts, where it has them, over those given for all
    assert pipeline_table([dict(fast, parts={"total": 55.0})], floor, own).splitlines()[2].endswith(" | +55.0 | 2.00x |")


def test_a_row_may_carry_its_own_arguments_after_its_mode():
    from splitrl.bench.pipeline_bench import _name, parse_row, row_arguments, row_label

    assert parse_row("sync") == ("sync", [])
    assert parse_row(" sync --threads 1 ") == ("sync", ["--threads", "1"])
    assert parse_row("+ async --rollout-groups 2 --channels-last") == ("+ async", ["--rollout-groups", "2",
                                                                                  "--channels-last"])
    assert row_label("sync  --threads  1") == "sync --threads 1"
    assert row_arguments("+ 4 envs --threads 1") == [*MODES["+ 4 envs"], "--threads", "1"]
    # The run directories of plain modes keep their names (--table-only reads older benches' runs)
    assert _name(0.0, "+ micro-batches at once") == "0ms-micro-batches-at-once"
    assert _name(20.0, "sync --threads 1") == "20ms-sync-threads-1"
    with pytest.raises(ValueError, match="unknown mode 'turbo'"):
        parse_row("turbo --threads 1")


def test_the_parts_each_row_computes_are_read_from_its_arguments_before_any_run():
    import torch

    from splitrl.cli.bench import _parts_key

    threads = torch.get_num_threads()
    assert _parts_key(("--num-envs", "4", "--rollout-groups", "2", "--channels-last")) == (False, True, threads, 4,
                                                                                           4096, 2)
    assert _parts_key(("--fused-adam", "--threads", "1")) == (True, False, 1, 1, 4096, 1)
    assert _parts_key(("--threads", "3", "--num-envs", "8", "--num-steps", "512")) == (False, False, 3, 8, 512, 1)
    assert _parts_key(("--num-envs", "8", "--rollout-groups", "auto"))[3:] == (8, 4096, 1)  # as at no round trip
    bad = splitrl_here("bench", "pipeline", "--modes", "sync", "--rtt", "0", "--", "--chanels-last", code=None)
    assert bad.exit_code != 0 and "--chanels-last" in bad.output
    bad = splitrl_here("bench", "pipeline", "--modes", "sync --thread 1", "--rtt", "0", code=None)
    assert bad.exit_code != 0 and "--thread" in bad.output
    bad = splitrl_here("bench", "pipeline", "--modes", "turbo", "--rtt", "0", code=None)
    assert bad.exit_code != 0 and "unknown mode" in bad.output


def test_the_twin_runs_in_one_process_at_no_round_trip_and_its_cpu_counts_once(tmp_path, monkeypatch):
    from splitrl.bench import pipeline_bench

    ran = []

    def run_local(args, run_dir, timeout, command="run"):
        ran.append((command, Path(run_dir).name))
        _run(Path(run_dir), [10.0, 10.0, 10.0], 1.5, 1.5, envs=0.0)
        # each kind of process writes its own config (`splitrl.runs.CONFIG_NAMES`): the twin's tells it apart
        names = ["config.json"] if command == "train" else ["config-stage0.json", "config-stage1.json"]
        for name in names:
            (Path(run_dir) / name).write_text('{"settings": {}}')

    monkeypatch.setattr(pipeline_bench, "run_local", run_local)
    rows = run_pipeline_bench(["twin", "sync"], [0.0], out_dir=str(tmp_path))
    assert ran == [("train", "0ms-twin"), ("run", "0ms-sync")]
    twin, sync = rows
    assert twin["cpu_per_iteration"] == pytest.approx(15.0) and twin["busy_stage1"] is None  # stage0's alone
    assert sync["cpu_per_iteration"] == pytest.approx(30.0)
    assert "| 0 ms | twin | 10.0 | 409.6 | 1.00 |  | 1.50 |  | 0.00 | 15.0 |" in pipeline_table(rows)
    # With a round trip there is no link to delay in the twin: only the split runs
    monkeypatch.setattr(pipeline_bench, "_run_in_lab", lambda args, run_dir, *rest: ran.append(("lab", run_dir.name))
                        or _run(run_dir, [10.0, 10.0, 10.0], 1.5, 1.5, envs=0.0))
    ran.clear()
    run_pipeline_bench(["twin", "sync"], [20.0], out_dir=str(tmp_path / "rtt"))
    assert ran == [("lab", "20ms-sync")]


def _fake_runs(monkeypatch, ran):
    """`run_local` writing three iterations of a run, and recording each row as it runs."""
    from splitrl.bench import pipeline_bench

    def run_local(args, run_dir, timeout, command="run"):
        ran.append(("row", Path(run_dir).name))
        _run(Path(run_dir), [10.0, 10.0, 10.0], 1.5, 1.5, envs=0.0)
        for name in ["config.json"] if command == "train" else ["config-stage0.json", "config-stage1.json"]:
            (Path(run_dir) / name).write_text('{"settings": {}}')

    monkeypatch.setattr(pipeline_bench, "run_local", run_local)


def _parts(total):
    """`measure_floor`'s dict for parts that add up to ``total`` CPU seconds."""
    from splitrl.bench.floor_bench import PARTS, _implied

    return _implied({part: total / len(PARTS) for part in PARTS}, 2, 4096, False)


def test_parts_beside_each_row_are_timed_right_before_and_after_it_and_shared_between_neighbours(tmp_path,
                                                                                                 monkeypatch):
    from splitrl.bench.pipeline_bench import PartsBeside

    ran = []
    _fake_runs(monkeypatch, ran)
    clock = iter(range(100))  # each timing's total: the machine slows down as the bench goes on

    def measure(kind):
        total = 60.0 + next(clock)
        ran.append(("parts", kind, total))
        return _parts(total)

    needs = {"sync": ["floor", "two threads"], "sync --threads 1": ["floor"],
             "+ micro-batches at once --channels-last": ["floor", "channels-last"]}
    beside = PartsBeside(measure, needs.__getitem__)
    run_pipeline_bench(list(needs), [0.0], out_dir=str(tmp_path), around=beside.around)
    assert ran == [("parts", "floor", 60.0), ("parts", "two threads", 61.0), ("row", "0ms-sync"),
                   ("parts", "floor", 62.0), ("parts", "two threads", 63.0),
                   ("row", "0ms-sync-threads-1"),  # the floor timed after sync is the one before it
                   ("parts", "floor", 64.0),
                   ("parts", "channels-last", 65.0),  # a kind the row before did not need: timed right before
                   ("row", "0ms-micro-batches-at-once-channels-last"),
                   ("parts", "floor", 66.0), ("parts", "channels-last", 67.0)]
    rows = beside.rows
    assert rows[(0.0, "sync")]["floor"]["total"] == pytest.approx(61.0)  # (60 + 62) / 2
    assert rows[(0.0, "sync")]["two threads"]["bracket"] == [61.0, 63.0]
    assert rows[(0.0, "sync --threads 1")]["floor"]["bracket"] == [62.0, 64.0]
    assert rows[(0.0, "+ micro-batches at once --channels-last")]["channels-last"]["bracket"] == [65.0, 67.0]
    assert [where for where, _, _ in beside.timings][:3] == ["before 0 ms sync", "before 0 ms sync",
                                                             "after 0 ms sync"]


def test_parts_beside_set_each_row_against_its_own_floor(tmp_path, monkeypatch):
    from splitrl.bench import floor_bench

    ran = []
    _fake_runs(monkeypatch, ran)
    totals = iter([20.0, 40.0, 60.0, 80.0])  # before twin, after twin (before sync), after sync; one kind each
    monkeypatch.setattr(floor_bench, "measure_floor", lambda settings, channels_last=False, threads=1:
                        _parts(next(totals)))
    out = splitrl_here("bench", "pipeline", "--modes", "twin --threads 1,sync --threads 1", "--rtt", "0",
                       "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "rows.json"), "--parts-beside")
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [row["floor"]["bracket"] for row in rows] == [[20.0, 40.0], [40.0, 60.0]]
    assert "parts" not in rows[0]  # the floor's own kind: no other parts
    lines = [line for line in out.output.splitlines() if line.startswith("| 0 ms")]
    # 10 s an iteration against floors of 15 and 25 s on two cores; 30 CPU-s (sync) against 30 and 50
    assert lines[0].endswith(" 0.67x | -15.0 | 0.50x |") and lines[1].endswith(" 0.40x | -20.0 | 0.60x |")
    assert "| before 0 ms twin --threads 1 | the floor (eager, one thread) | 20.00 |" in out.output
    assert next(totals) == 80.0  # three timings, not four: the one after the twin is the one before sync
