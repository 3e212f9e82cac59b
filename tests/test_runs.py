"""Run directories read back: bytes on the link and one summary for every benchmark, report and curve."""

import json

import pytest

from splitrl.runs import iteration_bytes, iteration_messages, link_bytes, link_messages, read_episodes
from splitrl.summary import has_records, run_history, summarise_run


def _write_metrics(run_dir, records):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_summary_leaves_out_the_first_iteration_and_counts_only_byte_keys(tmp_path):
    _write_metrics(tmp_path / "run", [
        {"iteration": 1, "time/iteration": 50.0, "net/fwd/sent_bytes": 900, "net/fwd/sent_messages": 7},
        {"iteration": 2, "time/iteration": 10.0, "net/fwd/sent_bytes": 600, "net/bwd/recv_bytes": 400,
         "net_total/fwd/sent_bytes": 1500, "net/fwd/sent_messages": 7, "time/link_wait": 2.0},
        {"iteration": 3, "time/iteration": 14.0, "net/fwd/sent_bytes": 800, "net/bwd/recv_bytes": 200},
    ])
    s = summarise_run(tmp_path / "run")
    assert s["iterations"] == 3 and s["iterations_used"] == 2
    assert s["seconds_per_iteration"] == 12.0
    assert s["bytes_per_iteration"] == 1000.0
    assert s["link_wait_per_iteration"] == 1.0
    _write_metrics(tmp_path / "one", [{"iteration": 1, "time/iteration": 7.0, "net/fwd/sent_bytes": 5}])
    assert summarise_run(tmp_path / "one")["seconds_per_iteration"] == 7.0  # a single iteration is all there is


def test_meters_are_summed_by_scope_and_direction():
    record = {
        "net/step/sent_bytes": 10, "net/action/recv_bytes": 5, "net/step/sent_messages": 2, "net/action/recv_messages": 2,
        "net_total/step/sent_bytes": 100, "net_total/action/recv_bytes": 50, "net_total/hello/sent_bytes": 7,
        "net_total/step/sent_messages": 20, "net_total/action/recv_messages": 20, "time/iteration": 3.0,
    }
    assert iteration_bytes(record) == 15 and iteration_messages(record, "recv") == 2 and iteration_messages(record) == 4
    assert link_bytes(record) == 157 and link_bytes(record, "sent") == 107 and link_bytes(record, "recv") == 50
    assert link_messages(record, "sent") == 20


def test_summary_has_totals_returns_and_settings(tmp_path):
    run = tmp_path / "paper"
    _write_metrics(run, [
        {"iteration": i, "global_step": 32 * i, "charts/SPS": 10.0 * i, "time/iteration": 3.2, "time/total": 3.2 * i,
         "charts/episodic_return_ema": float(i), "net_total/step/sent_bytes": 1000 * i, "net/step/sent_bytes": 1000}
        for i in (1, 2, 3)
    ])
    (run / "config-stage0.json").write_text(json.dumps({"settings": {"cut": "cnn", "codecs": {"codec_bwd": "paper"}}}))
    (run / "episodes.jsonl").write_text("".join(json.dumps({"iteration": i, "return": 10.0 * i}) + "\n" for i in (1, 2, 3)))
    s = summarise_run(run)
    assert s["run"] == "paper" and s["cut"] == "cnn" and s["codecs"] == "fp32 / fp32 / paper"
    assert s["iterations"] == 3 and s["steps"] == 96 and s["total_bytes"] == 3000
    assert s["bytes_per_step"] == pytest.approx(3000 / 96) and s["wall_seconds"] == pytest.approx(9.6)
    assert s["final_ema"] == 3.0 and s["last_episodes_mean"] == 20.0
    assert s["steps_per_second"] == 25.0  # iterations 2 and 3
    assert summarise_run(run, skip_first=False)["steps_per_second"] == 20.0
    first = summarise_run(run, upto=1)
    assert first["iterations"] == 1 and first["total_bytes"] == 1000 and first["last_episodes_mean"] == 10.0
    assert read_episodes(tmp_path) == []  # no episode finished yet
    with pytest.raises(ValueError, match="no iterations"):
        summarise_run(run, upto=0)


def test_a_resumed_runs_wall_time_adds_up_its_sessions(tmp_path):
    """time/total restarts with each process: three sessions of 100 + 40 + 25 s, not the last one's 25."""
    totals = [30.0, 70.0, 100.0, 20.0, 40.0, 25.0]
    _write_metrics(tmp_path / "run", [{"iteration": i + 1, "time/iteration": 10.0, "time/total": t}
                                      for i, t in enumerate(totals)])
    assert summarise_run(tmp_path / "run")["wall_seconds"] == 165.0
    assert summarise_run(tmp_path / "run", upto=4)["wall_seconds"] == 120.0


def test_skip_last_leaves_out_an_asynchronous_runs_lone_training(tmp_path):
    _write_metrics(tmp_path / "run", [{"iteration": i, "time/iteration": t, "net/fwd/sent_bytes": 1}
                                      for i, t in ((1, 90.0), (2, 50.0), (3, 54.0), (4, 30.0))])
    assert summarise_run(tmp_path / "run")["seconds_per_iteration"] == pytest.approx(134 / 3)
    steady = summarise_run(tmp_path / "run", skip_last=True)
    assert steady["seconds_per_iteration"] == 52.0 and steady["iterations_used"] == 2
    _write_metrics(tmp_path / "two", [{"iteration": i, "time/iteration": 10.0 * i} for i in (1, 2)])
    assert summarise_run(tmp_path / "two", skip_last=True)["seconds_per_iteration"] == 20.0  # one is all there is


def test_checkpoints_after_an_iteration_can_be_dropped(tmp_path):
    """An edge that joins a resumed fleet after iteration k drops its own later checkpoints (another past)."""
    from splitrl.runs import RunLog, checkpoint_iterations

    log = RunLog(tmp_path / "run")
    for i in (3, 4, 5, 6):
        log.checkpoint("stage0", i, {"i": i})
    log.checkpoint("stage1", 6, {"i": 6})
    log.drop_checkpoints_after("stage0", 4)
    assert checkpoint_iterations(tmp_path / "run", "stage0") == [3, 4]
    assert checkpoint_iterations(tmp_path / "run", "stage1") == [6]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "stage0-iter00003.pt", "stage0-iter00003.pt.sha256", "stage0-iter00004.pt", "stage0-iter00004.pt.sha256",
        "stage1-iter00006.pt", "stage1-iter00006.pt.sha256"]
    log.close()


def _fleet(tmp_path):
    """A fleet's run directory: edge 0 for three iterations, edge 1 dropped after the first (its link still
    counts), each with its own episodes (global env ids) and config."""
    run = tmp_path / "fleet"
    for edge, iterations in ((0, (1, 2, 3)), (1, (1,))):
        d = run / f"edge-{edge}"
        _write_metrics(d, [
            {"iteration": i, "global_step": 64 * i, "charts/SPS": 8.0, "time/iteration": 8.0, "time/total": 8.0 * i,
             "charts/episodic_return_ema": -1.0, "net/step/sent_bytes": 100 + edge, "net_total/step/sent_bytes":
             (100 + edge) * i, "net/action/recv_messages": 2}
            for i in iterations
        ])
        (d / "config-stage0.json").write_text(json.dumps({"settings": {"cut": "cnn", "codecs": {"codec_fwd": "bf16"}}}))
        episodes = [(1, 40, 10.0), (3, 150, 30.0)] if edge == 0 else [(1, 30, 20.0)]
        (d / "episodes.jsonl").write_text("".join(
            json.dumps({"iteration": i, "global_step": g, "env": edge, "return": r}) + "\n" for i, g, r in episodes))
    (run / "config-stage1.json").write_text("{}")
    return run


def test_a_fleets_history_is_merged_per_iteration(tmp_path):
    history = run_history(_fleet(tmp_path))
    assert [r["iteration"] for r in history.records] == [1, 2, 3]
    assert [iteration_bytes(r) for r in history.records] == [201, 100, 100]  # the edges of each iteration
    assert [link_bytes(r) for r in history.records] == [201, 301, 401]  # the dropped edge's link stays counted
    assert [r["net/action/recv_messages"] for r in history.records] == [4, 2, 2]
    assert [e["return"] for e in history.episodes] == [20.0, 10.0, 30.0]  # by global step across edges
    first_ema = 0.9 * 20.0 + 0.1 * 10.0
    assert [r["charts/episodic_return_ema"] for r in history.records] == pytest.approx(
        [first_ema, first_ema, 0.9 * first_ema + 0.1 * 30.0])  # the fleet's, not edge 0's -1
    assert [r["charts/episodes"] for r in history.records] == [2, 0, 1]
    assert history.records[0]["charts/episodic_return"] == 15.0 and history.records[1]["charts/episodic_return"] is None
    assert history.settings_dir.name == "edge-0"
    s = summarise_run(tmp_path / "fleet")
    assert s["total_bytes"] == 401 and s["bytes_per_iteration"] == 100.0 and s["codecs"] == "fp32 / bf16 / fp32"
    assert s["final_ema"] == pytest.approx(0.9 * first_ema + 0.1 * 30.0) and s["last_episodes_mean"] == 20.0
    upto = run_history(tmp_path / "fleet", upto=1)
    assert len(upto.records) == 1 and [e["return"] for e in upto.episodes] == [20.0, 10.0]
    with pytest.raises(ValueError, match="no iterations"):
        run_history(tmp_path / "fleet", upto=0)


def test_a_fleets_curve_report_and_kind_table_read_every_edge(tmp_path):
    from splitrl.bench.learning_bench import kind_table
    from splitrl.report import curve_table, load_run

    run = _fleet(tmp_path)
    assert has_records(run) and has_records(run / "edge-1") and not has_records(tmp_path)  # `splitrl report` takes it
    curve = curve_table(run).splitlines()
    assert len(curve) == 5 and curve[2].startswith("| 1 | 64 | 19.0 | 15.0 | 2 |")
    series = load_run(run)
    assert series.cumulative_bytes == [201, 301, 401] and series.ema[-1] == pytest.approx(0.9 * 19.0 + 3.0)
    assert series.label == "fleet: fp32 / bf16 / fp32"
    step_cell = kind_table([run]).splitlines()[-1].split("|")[2].strip()
    assert step_cell == f"{401 / 192:,.1f}"


def test_a_fleet_whose_furthest_edge_joined_late_keeps_the_iterations_before_it(tmp_path):
    """Edge 0 trains iterations 1-3 and is dropped; edge 1 joins at 2 and goes on to 5: every iteration is in the
    merged history, each with the bytes of the edges that ran it and its own episodes."""
    run = tmp_path / "fleet"
    for edge, iterations in ((0, (1, 2, 3)), (1, (2, 3, 4, 5))):
        d = run / f"edge-{edge}"
        _write_metrics(d, [{"iteration": i, "global_step": 64 * i, "time/iteration": 8.0 + edge,
                            "net/step/sent_bytes": 10 ** edge, "net_total/step/sent_bytes": 10 ** edge * i}
                           for i in iterations])
        (d / "episodes.jsonl").write_text("".join(
            json.dumps({"iteration": i, "global_step": 64 * i - 1, "env": edge, "return": float(i)}) + "\n"
            for i in iterations))
    history = run_history(run)
    assert [r["iteration"] for r in history.records] == [1, 2, 3, 4, 5]
    assert [iteration_bytes(r) for r in history.records] == [1, 11, 11, 10, 10]
    assert [r["charts/episodes"] for r in history.records] == [1, 2, 2, 1, 1]
    assert [r["time/iteration"] for r in history.records] == [8.0, 9.0, 9.0, 9.0, 9.0]  # the furthest edge's where it ran
    assert link_bytes(history.records[-1]) == 3 + 50 and history.settings_dir.name == "edge-1"
    assert summarise_run(run)["iterations_used"] == 4  # all but the first, as for one run


@pytest.mark.parametrize("damage", ["a read error", "a checksum file that is not text"])
def test_a_newest_checkpoint_that_cannot_be_read_is_passed_over_with_a_warning(tmp_path, monkeypatch, caplog, damage):
    """Resume's choice (`intact_checkpoints`): a checkpoint whose bytes or checksum cannot be read counts as damaged
    (a checksum that does not match: tests/schedule/test_resume.py, end to end)."""
    from pathlib import Path

    from splitrl.runs import RunLog, checkpoint_path, intact_checkpoints, load_checkpoint

    log = RunLog(tmp_path / "run")
    for i in (1, 2):
        log.checkpoint("stage0", i, {"i": i})
    log.close()
    newest = checkpoint_path(tmp_path / "run", "stage0", 2)
    if damage == "a read error":
        read_bytes = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda self: (_ for _ in ()).throw(OSError(5, "Input/output error",
                            str(self))) if self == newest else read_bytes(self))
    else:
        newest.with_name(newest.name + ".sha256").write_bytes(b"\xff\xfe")
    assert intact_checkpoints(tmp_path / "run", "stage0") == [1]
    assert str(newest) in caplog.text and "passed over" in caplog.text
    assert load_checkpoint(tmp_path / "run", "stage0", 1) == {"i": 1}
