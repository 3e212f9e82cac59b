"""`splitrl report`: both figures, the table and TensorBoard files from two small generated run directories;
`splitrl curve`: one run's learning curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from splitrl.cli import main
from splitrl.report import curve_table, load_run, make_report

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(path: Path, codecs: dict[str, str], bytes_per_step: int, returns: list[float], steps: int = 512) -> Path:
    """A run directory as the stages write it: config, metrics (stage0's meters) and episodes."""
    path.mkdir(parents=True)
    (path / "config-stage0.json").write_text(json.dumps({"settings": {"cut": "cnn", "codecs": codecs}}))
    ema = None
    with open(path / "metrics.jsonl", "w") as metrics, open(path / "episodes.jsonl", "w") as episodes:
        for i, ret in enumerate(returns, start=1):
            ema = ret if ema is None else 0.9 * ema + 0.1 * ret
            step = i * steps
            sent, received = 3 * bytes_per_step * step // 4, bytes_per_step * step // 4
            metrics.write(json.dumps({
                "iteration": i, "global_step": step, "charts/episodic_return_ema": ema, "charts/SPS": 20.0,
                "time/iteration": steps / 20.0, "time/total": i * steps / 20.0, "losses/approx_kl": 0.01,
                "net_total/features/sent_bytes": sent, "net_total/features/sent_messages": step,
                "net_total/action/recv_bytes": received, "net_total/action/recv_messages": step,
            }) + "\n")
            episodes.write(json.dumps({"iteration": i, "return": ret}) + "\n")
    return path


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    fp32 = fake_run(tmp_path / "fp32", {"codec_rollout": "fp32", "codec_fwd": "fp32", "codec_bwd": "fp32"},
                    bytes_per_step=344_000, returns=[-40.0, 0.0, 100.0])
    paper = fake_run(tmp_path / "paper", {"codec_rollout": "fp32", "codec_fwd": "fp32", "codec_bwd": "paper"},
                     bytes_per_step=172_000, returns=[-40.0, -20.0, 10.0])
    return [fp32, paper]


def test_report_writes_both_figures_and_the_table(runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "report"
    paths = make_report(runs, out)
    for name in ("return.png", "bytes.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000
    lines = paths["table"].splitlines()
    assert len(lines) == 4
    fp32, paper = (line.split("|") for line in lines[2:])
    assert fp32[1].strip() == "fp32" and paper[1].strip() == "paper"
    assert fp32[5].strip() == f"{344_000 * 1536:,}" and paper[5].strip() == f"{172_000 * 1536:,}"
    assert fp32[6].strip() == "344,000" and paper[6].strip() == "172,000"
    assert fp32[7].strip() == "1.0" and paper[7].strip() == "2.0"
    assert float(fp32[8]) == pytest.approx(0.81 * -40 + 0.09 * 0 + 0.1 * 100, abs=0.06)
    assert fp32[9].strip() == "20.0"
    assert "![return](return.png)" in (out / "report.md").read_text()


def test_the_paper_codec_marks_its_warm_start(runs: list[Path]) -> None:
    assert load_run(runs[0]).warm_start is None
    assert load_run(runs[1]).warm_start == 30_000
    assert load_run(runs[1]).label == "paper: fp32 / fp32 / paper"


def test_tensorboard_event_files_hold_the_metrics(runs: list[Path], tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    make_report(runs, tmp_path / "report", tensorboard=True)
    events = EventAccumulator(str(tmp_path / "report" / "tensorboard" / "paper"))
    events.Reload()
    ema = events.Scalars("charts/episodic_return_ema")
    assert [e.step for e in ema] == [512, 1024, 1536]
    assert ema[0].value == pytest.approx(-40.0)
    cumulative = events.Scalars("net/link_bytes_cumulative")
    assert cumulative[-1].value == pytest.approx(172_000 * 1536)


def test_cli_report_and_its_errors(runs: list[Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", *map(str, runs), "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert "| paper |" in result.output and (tmp_path / "cli" / "bytes.png").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(main, ["report", str(empty), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "no metrics.jsonl" in result.output

    twin = tmp_path / "other" / "fp32"
    twin.parent.mkdir()
    fake_run(twin, {}, bytes_per_step=1, returns=[1.0])
    result = CliRunner().invoke(main, ["report", str(runs[0]), str(twin), "--out", str(tmp_path / "y")])
    assert result.exit_code == 2 and "distinct names" in result.output


def test_a_run_still_starting_is_reported(tmp_path: Path) -> None:
    """No episode finished yet (no episodes.jsonl) and a last metrics line half written."""
    run = fake_run(tmp_path / "young", {}, bytes_per_step=100, returns=[5.0, 6.0])
    (run / "episodes.jsonl").unlink()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "global_st')
    paths = make_report([run], tmp_path / "report")
    row = paths["table"].splitlines()[2].split("|")
    assert row[3].strip() == "2" and row[1].strip() == "young"
    assert (tmp_path / "report" / "return.png").exists()

    with open(run / "metrics.jsonl", "a") as f:
        f.write('\n{"iteration": 4}\n')
    with pytest.raises(ValueError, match="line 3 is not JSON"):
        make_report([run], tmp_path / "again")


def test_curve_prints_one_row_per_iteration(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"iteration": 1, "global_step": 4096, "charts/episodic_return_ema": -40.0, "charts/episodic_return": -41.5,
         "charts/episodes": 4, "charts/SPS": 50.0, "net_total/step/sent_bytes": 2_000_000,
         "net_total/action/recv_bytes": 1_000_000},
        {"iteration": 2, "global_step": 8192, "charts/episodic_return_ema": None, "charts/episodic_return": None,
         "charts/episodes": 0, "charts/SPS": 60.0, "net_total/step/sent_bytes": 4_000_000,
         "net_total/action/recv_bytes": 2_000_000},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = curve_table(run).splitlines()
    assert lines[2] == "| 1 | 4096 | -40.0 | -41.5 | 4 | 50.0 | 3 |"
    assert lines[3] == "| 2 | 8192 | - | - | 0 | 60.0 | 6 |"


def test_the_table_gains_the_held_out_eval_score_where_a_run_has_one(runs: list[Path], tmp_path: Path) -> None:
    from splitrl.report import report_table
    from splitrl.stages.evaluate import append_eval

    assert "held-out eval" not in report_table([load_run(run) for run in runs])
    append_eval(runs[1], {"iteration": 2, "episodes": 10, "return_mean": 1.0, "return_std": 9.0,
                          "deterministic": True})
    append_eval(runs[1], {"iteration": 3, "episodes": 10, "return_mean": 512.25, "return_std": 31.5,
                          "deterministic": True})
    append_eval(runs[1], {"iteration": 3, "episodes": 5, "return_mean": 700.0, "return_std": 4.0,
                          "deterministic": False})
    lines = report_table([load_run(run) for run in runs]).splitlines()
    assert lines[0].endswith("| held-out eval return: deterministic / sampled |")
    assert lines[2].split("|")[-2].strip() == "n/a / n/a"
    # each mode's newest line, side by side: a sampled score never stands in for a deterministic one
    assert lines[3].split("|")[-2].strip() == ("512.2 ± 31.5 (10 episodes, iteration 3) / "
                                               "700.0 ± 4.0 (5 episodes, iteration 3)")
    append_eval(runs[1], {"iteration": 4, "episodes": 5, "return_mean": 800.0, "return_std": 2.0,
                          "deterministic": False})  # a newer sampled line replaces only the sampled cell
    lines = report_table([load_run(run) for run in runs]).splitlines()
    assert lines[3].split("|")[-2].strip() == ("512.2 ± 31.5 (10 episodes, iteration 3) / "
                                               "800.0 ± 2.0 (5 episodes, iteration 4)")
