"""Command-line conventions: --version, choices, what `train` offers, per-stream codec help, whole iterations."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from splitrl.cli import main
from splitrl.settings import CODEC_STREAMS


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_version():
    result = _run("--version")
    assert result.exit_code == 0 and result.output.startswith("splitrl ")


@pytest.mark.parametrize("option, bad", [("--cut", "middle"), ("--action-map", "wrap"), ("--transport", "udp"),
                                         ("--vector", "threads")])
def test_options_with_a_fixed_set_of_values_are_choices(option, bad):
    result = _run("stage0", option, bad)
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output and "is not one of" in result.output


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
