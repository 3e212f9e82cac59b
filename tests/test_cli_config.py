"""--config FILE: any option of a training command from a TOML (or YAML) file, the command line winning."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

import splitrl.launch
import splitrl.runner
from splitrl.cli import main
from splitrl.settings import RunOptions, TrainSettings


@pytest.fixture
def built(monkeypatch):
    """Run `splitrl train` / `splitrl run` up to what they would start: the settings and options they built
    (the twin's), or the stage argv and endpoint (the launcher's)."""
    seen: dict = {}

    def twin(settings, options):
        seen.update(settings=settings, options=options)

    def launch(stage_args, run_dir, **kwargs):
        seen.update(stage_args=stage_args, run_dir=run_dir, **kwargs)
        return 0

    monkeypatch.setattr(splitrl.runner, "train_twin", twin)
    monkeypatch.setattr(splitrl.launch, "launch_split", launch)

    def invoke(*args):
        import torch

        threads = torch.get_num_threads()  # `splitrl run` checks on one thread
        try:
            return CliRunner().invoke(main, list(args)), seen
        finally:
            torch.set_num_threads(threads)

    return invoke


TOML = """
seed = 7
num-envs = 2
codec_rollout = "bf16"
async = true
gamma = 0.9
timeout = 12.5
"""


def test_a_toml_file_sets_options_and_the_command_line_wins(tmp_path, built):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    result, seen = built("train", "--config", str(path), "--seed", "8")
    assert result.exit_code == 0, result.output
    s, o = seen["settings"], seen["options"]
    assert (s.seed, s.env.num_envs, s.codecs.codec_rollout, s.schedule.asynchronous, s.ppo.gamma, o.timeout) == \
        (8, 2, "bf16", True, 0.9, 12.5)
    assert s.ppo.num_steps == TrainSettings().ppo.num_steps  # what the file does not set keeps its default


def test_the_file_may_set_a_commands_own_options(tmp_path, built):
    path = tmp_path / "run.toml"
    path.write_text(f'endpoint = "ipc://{tmp_path}/link"\nrun-dir = "{tmp_path}/run"\nthreads = 1\n')
    result, seen = built("run", "--config", str(path))
    assert result.exit_code == 0, result.output
    assert seen["endpoint"] == f"ipc://{tmp_path}/link" and seen["run_dir"] == f"{tmp_path}/run"
    assert "--threads" in seen["stage_args"] and seen["stage_args"][seen["stage_args"].index("--threads") + 1] == "1"


@pytest.mark.parametrize("text, words", [
    ("num-envs = 2\nnum_env = 3\n", "unknown key 'num_env': not an option of `splitrl train`"),
    ("connect = 'tcp://127.0.0.1:5555'\n", "unknown key 'connect'"),  # stage0's, not the twin's
    ("[ppo]\ngamma = 0.9\n", "unknown key 'ppo'"),
    ("seed = [1, 2]\n", "seed must be a number, a string or true/false, got list"),
    ("seed = 1\nseed 2\n", "--config"),  # not TOML
])
def test_what_the_file_cannot_set_is_one_line_naming_it(tmp_path, built, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result, seen = built("train", "--config", str(path))
    assert result.exit_code == 2 and not seen
    assert result.stderr.startswith(f"error: --config {path}") and result.stderr.count("\n") == 1
    assert words in result.stderr


def test_a_yaml_file_sets_options_too(tmp_path, built):
    pytest.importorskip("yaml")
    path = tmp_path / "run.yaml"
    path.write_text("seed: 7\nnum-envs: 2\nasync: true\n")
    result, seen = built("train", "--config", str(path), "--num-envs", "4")
    assert result.exit_code == 0, result.output
    s = seen["settings"]
    assert (s.seed, s.env.num_envs, s.schedule.asynchronous) == (7, 4, True)


def test_a_resumed_run_compares_the_files_values_with_its_own(tmp_path, built):
    """What the file sets counts as given: a training setting in it must be the run's."""
    run = tmp_path / "run"
    run.mkdir()
    saved = {"settings": TrainSettings(seed=5).for_observation("image").to_dict(),
             "options": dataclasses.asdict(RunOptions()), "env_spec": {"observation": "image"}}
    (run / "config.json").write_text(json.dumps(saved))
    path = tmp_path / "run.toml"
    path.write_text(f'resume = "{run}"\nseed = 6\n')
    result, seen = built("train", "--config", str(path))
    assert result.exit_code == 2 and not seen
    assert "--seed 6 (the run has --seed 5)" in result.stderr and result.stderr.count("\n") == 1
    path.write_text(f'resume = "{run}"\nseed = 5\ntimeout = 3\n')
    result, seen = built("train", "--config", str(path))
    assert result.exit_code == 0, result.output
    assert seen["settings"].seed == 5 and seen["options"].timeout == 3 and seen["options"].resume == str(run)
