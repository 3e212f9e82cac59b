"""--resume DIR goes on with the run's own settings: a run started with other than the defaults, stopped after
its first iteration and resumed with ``--resume DIR --total-steps N`` alone, ends bit for bit as the run that was
never stopped; a training setting given again with another value is refused in one line naming it."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from splitrl.settings import RUNTIME, RunOptions, SettingsError, TrainSettings, resumed

from ..conftest import script, train_in_process

CUSTOM = ["--num-steps", "16", "--epochs", "2", "--minibatches", "2", "--max-episode-steps", "20", "--threads", "1",
          "--seed", "3", "--num-envs", "2", "--hidden", "32", "--codec-rollout", "bf16", "--gamma", "0.98",
          "--keep-checkpoints", "0"]
"""Not the defaults: another seed, two envs, a narrower head, a lossy rollout codec, another discount."""
ITERATION = 32  # --num-steps 16 x --num-envs 2
TOTAL = 3 * ITERATION


def _totals(run_dir):
    """The link's totals at the end of the run, but the hellos (a resumed run says hello once more)."""
    last = json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    return {k: v for k, v in last.items() if k.startswith("net_total/") and not k.startswith("net_total/hello/")}


def _assert_same(run, straight):
    found, compared = script("same_runs").differences(Path(run), Path(straight), net="none")
    assert not found and compared > 0, found
    assert _totals(run) == _totals(straight)


def _trained(tmp_path_factory, name: str, steps: int) -> Path:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    done = train_in_process("--run-dir", str(run_dir), *CUSTOM, "--total-steps", str(steps))
    assert done.exit_code == 0, done.output[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run never stopped."""
    return _trained(tmp_path_factory, "straight", TOTAL)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The same run stopped after its first iteration."""
    return _trained(tmp_path_factory, "stopped", ITERATION)


def test_the_twin_resumed_with_nothing_but_its_length_ends_bit_for_bit_as_the_run_never_stopped(
        tmp_path, stopped, straight):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    done = train_in_process("--resume", str(run), "--total-steps", str(TOTAL))
    assert done.exit_code == 0, done.output[-3000:]
    _assert_same(run, straight)
    config = json.loads((run / "config.json").read_text())
    assert config["settings"] == json.loads((straight / "config.json").read_text())["settings"]
    assert config["options"]["threads"] == 1 and config["options"]["keep_checkpoints"] == 0  # as the run ran


def test_the_split_resumed_with_nothing_but_its_length_ends_bit_for_bit_as_the_run_never_stopped(
        tmp_path, spawn, straight):
    """The launcher reads stage1's config and hands both stages the run's settings."""
    run = tmp_path / "run"
    code, out = spawn("run", "--run-dir", str(run), *CUSTOM, "--total-steps", str(ITERATION)).finish(timeout=300)
    assert code == 0, out
    code, out = spawn("run", "--resume", str(run), "--total-steps", str(TOTAL)).finish(timeout=300)
    assert code == 0, out
    assert "resuming after iteration 1" in out
    _assert_same(run, straight)


def test_a_training_setting_given_again_must_be_the_runs_and_run_time_options_may_change(tmp_path, stopped):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    refused = train_in_process("--resume", str(run), "--seed", "4", "--no-norm-adv", "--total-steps", str(TOTAL))
    assert refused.exit_code == 2
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("error: ")  # one line, no usage block
    assert "--seed 4 (the run has --seed 3)" in refused.stderr
    assert "--no-norm-adv (the run has --norm-adv)" in refused.stderr
    assert "only --total-steps and the run-time options" in refused.stderr and "--timeout" in refused.stderr
    assert not (run / "checkpoints" / "stage0-iter00002.pt").exists()  # refused before anything ran
    # The same values are fine, as are the run-time options and another length; --model auto compares as what
    # it became for the run's images (the config holds 'nature').
    again = train_in_process("--resume", str(run), "--seed", "3", "--num-envs", "2", "--model", "auto",
                             "--timeout", "30", "--total-steps", str(2 * ITERATION))
    assert again.exit_code == 0, again.output[-3000:]
    config = json.loads((run / "config.json").read_text())
    assert config["options"]["timeout"] == 30 and config["settings"]["total_steps"] == 2 * ITERATION


def test_a_resume_directory_that_is_no_run_is_one_line(tmp_path):
    for where, words in ((tmp_path / "nothing", "no such directory"),
                         (tmp_path, "no config.json there (not a run directory of the twin?)")):
        refused = train_in_process("--resume", str(where))
        assert refused.exit_code == 2 and refused.stderr == f"error: --resume {where}: {words}\n"


def _saved(settings, options, kind="image"):
    """What a run's config holds (`splitrl.runner.rundir.prepare`)."""
    return {"settings": settings.for_observation(kind).to_dict(), "options": dataclasses.asdict(options),
            "env_spec": {"observation": kind}}


def test_options_not_given_are_the_runs_and_only_run_time_ones_may_differ():
    ran = RunOptions(timeout=9.0, eval_every=2, checkpoint_every=3, vector="sync", resume="", run_dir="old")
    saved = _saved(TrainSettings(seed=5), ran)
    settings, options = resumed(TrainSettings(), RunOptions(resume="r"), {"resume"}, saved)
    assert settings.seed == 5 and settings.model == "nature"  # the run's, as it ran
    assert (options.timeout, options.eval_every, options.checkpoint_every, options.vector) == (9.0, 2, 3, "sync")
    assert (options.resume, options.run_dir) == ("r", "")  # where the run is: --resume's, not the config's
    _, options = resumed(TrainSettings(), RunOptions(resume="r", timeout=1.0), {"resume", "timeout"}, saved)
    assert options.timeout == 1.0
    with pytest.raises(SettingsError, match=r"--eval-every 3 \(the run has --eval-every 2\)"):
        resumed(TrainSettings(), RunOptions(resume="r", eval_every=3), {"resume", "eval_every"}, saved)
    # A config from before an option existed ran with its default.
    old = {**saved, "options": {k: v for k, v in saved["options"].items() if k != "eval_episodes"}}
    with pytest.raises(SettingsError, match=r"--eval-episodes 7 \(the run has --eval-episodes 5\)"):
        resumed(TrainSettings(), RunOptions(resume="r", eval_episodes=7), {"resume", "eval_episodes"}, old)


def test_the_run_time_options_are_options():
    names = {f.name for f in dataclasses.fields(RunOptions)}
    assert set(RUNTIME) <= names and len(set(RUNTIME)) == len(RUNTIME)
    assert not {"eval_every", "eval_episodes", "act_wait", "learners", "edge_id"} & set(RUNTIME)
