"""Command-line conventions: --version, choices, what `train` offers, per-stream codec help, whole iterations."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from splitrl.cli import main
from splitrl.settings import CODEC_STREAMS


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_the_command_and_its_help_import_no_torch():
    """Every command imports torch when it runs, not when the command group loads: --help, `keys` (the transport's
    keys alone) and `netem` answer in a fraction of a second."""
    import subprocess
    import sys

    probe = "import sys, splitrl.cli, splitrl.transport.curve; print(sorted(m for m in ('torch', 'gymnasium', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_version():
    result = _run("--version")
    assert result.exit_code == 0 and result.output.startswith("splitrl ")


@pytest.mark.parametrize("option, bad", [("--action-map", "wrap"), ("--transport", "udp"), ("--vector", "threads")])
def test_options_with_a_fixed_set_of_values_are_choices(option, bad):
    result = _run("stage0", option, bad)
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output and "is not one of" in result.output


def test_the_model_and_the_cut_are_named_freely_and_a_model_that_is_none_is_refused_at_once():
    """--cut takes any layer of the model (checked once the env's shape is known, `splitrl.models`); --model a
    built-in or module:factory."""
    text = " ".join(_run("stage0", "--help").output.split())
    for option in ("--model TEXT", "--model-kwargs TEXT", "--cut TEXT", "--hidden INTEGER"):
        assert option in text
    result = _run("stage0", "--connect", "tcp://127.0.0.1:9", "--start-timeout", "600", "--model", "resnet")
    assert result.exit_code == 2 and "--model 'resnet': unknown model (built-ins: nature, impala, mlp" in result.output


def test_a_cut_the_model_has_not_is_refused_before_any_socket_or_run_directory(tmp_path):
    result = _run("stage1", "--bind", "tcp://127.0.0.1:0", "--cut", "bogus", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and "cut 'bogus' is not a layer of model 'nature'" in result.output
    assert "conv1" in result.output and not (tmp_path / "run").exists()


def test_train_offers_no_link_options():
    train = _run("train", "--help").output
    stage1 = _run("stage1", "--help").output
    for option in ("--transport", "--curve", "--insecure", "--heartbeat", "--rejoin"):
        assert option not in train and option in stage1
    assert "--eval-every" in train and "--tensorboard" in train


def test_each_codec_option_lists_what_its_stream_accepts():
    from splitrl.codecs import CODECS

    assert CODEC_STREAMS == {stream: tuple(n for n, c in CODECS.items() if stream in c.streams)
                             for stream in ("rollout", "fwd", "bwd")}
    text = " ".join(_run("stage0", "--help").output.split())
    assert "--codec-bwd TEXT codec of the gradient stage1 sends back in training (every minibatch); one of fp32, bf16, " \
           "fp16, int8, paper, ef," in text
    assert "(stage0 -> stage1, every env step); one of fp32, bf16, fp16, int8, relu, frames," in text


def test_total_steps_must_be_whole_iterations_and_the_error_says_which():
    result = _run("train", "--total-steps", "50", "--num-steps", "32")
    assert result.exit_code == 2
    assert "--total-steps 50 is not a whole number of iterations of 32 steps (num_steps x num_envs x edges): use 32 or 64" \
        in result.output


def test_the_learning_table_of_a_directory_lists_every_run_in_it(tmp_path):
    import json

    for name, ema in (("bf16", 500.0), ("ours-bottleneck-seed2", 480.0), ("bf16-seed1", 510.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(
            {"iteration": 1, "global_step": 4096, "time/iteration": 80.0, "time/total": 81.0,
             "charts/episodic_return_ema": ema, "net_total/step/sent_bytes": 4096 * 100}) + "\n")
    (tmp_path / "notes").mkdir()  # not a run
    result = _run("bench", "learning", "--table-only", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    rows = [line.split("|")[1].strip() for line in result.output.splitlines()[2:]]
    assert rows == ["bf16", "bf16-seed1", "ours-bottleneck-seed2"]  # the known configurations first, then by name
    result = _run("bench", "learning", "--table-only", "--out", str(tmp_path), "--config", "bf16")
    assert [line.split("|")[1].strip() for line in result.output.splitlines()[2:]] == ["bf16"]


def test_a_fleets_row_counts_every_edges_bytes_and_episodes(tmp_path):
    """A fleet's run directory holds its edges' records (RUN_DIR/edge-K): the row's bytes are every edge's link's,
    its EMA the one over every edge's episodes in the order one edge of all the envs would finish them."""
    import json

    fleet = tmp_path / "fleet-bf16-avg"
    episodes = {0: [(10, 0, 100.0), (30, 0, 300.0)], 2: [(20, 2, 200.0)]}  # (global_step, env, return) each
    for k in (0, 2):  # edge 1 never wrote a record (it never came): the others count all the same
        (fleet / f"edge-{k}").mkdir(parents=True)
        (fleet / f"edge-{k}" / "metrics.jsonl").write_text(json.dumps(
            {"iteration": 1, "global_step": 64, "time/iteration": 8.0, "time/total": 9.0,
             "charts/episodic_return_ema": 0.0, "net_total/step/sent_bytes": 64 * (k // 2 + 1)}) + "\n")
        (fleet / f"edge-{k}" / "episodes.jsonl").write_text("".join(
            json.dumps({"global_step": g, "iteration": 1, "env": e, "return": r, "length": 10}) + "\n"
            for g, e, r in episodes[k]))
    result = _run("bench", "learning", "--table-only", "--by-kind", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    cells = [c.strip() for c in result.output.splitlines()[2].split("|")]
    ema = 0.9 * (0.9 * 100.0 + 0.1 * 200.0) + 0.1 * 300.0  # 100, then 200 (edge 2), then 300
    assert cells[1] == "fleet-bf16-avg" and cells[6] == "3" and cells[8] == f"{ema:.1f}" and cells[9] == "200.0"
    assert "| fleet-bf16-avg | 3.0 |" in result.output  # bytes per env step by kind: step, both edges
