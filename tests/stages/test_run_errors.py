"""One error, once, at once: `splitrl run` finds every problem either stage would before it starts one (a wrong env
id or run directory first, before torch loads; then every other, together); a problem found later is printed once,
by the stage that found it, without a usage line for a command nobody typed."""

import os
import time

import pytest
from click.testing import CliRunner

import splitrl.launch
from splitrl.cli.errors import run_cli
from splitrl.errors import SettingsError
from splitrl.launch import SUPERVISED_ENV, launch_split
from splitrl.transport import PeerAbort

from ..conftest import TINY, splitrl_here


@pytest.fixture
def launches(monkeypatch):
    """The stage argvs `splitrl run` went on to start (none, where it refused)."""
    started: list = []
    monkeypatch.setattr(splitrl.launch, "launch_split", lambda *args, **kwargs: started.append(args) or 0)
    return started


def _bad_inputs(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a run")
    return {
        "env id": (["--env-id", "NoSuchEnv-v0"], "--env-id 'NoSuchEnv-v0'"),
        "run dir that is a file": (["--run-dir", str(a_file)], f"--run-dir {a_file} is a file, not a directory"),
        "run dir under a file": (["--run-dir", str(a_file / "run")], f"{a_file} is a file, not a directory"),
        "setting": (["--num-envs", "0"], "--num-envs must be >= 1, got 0"),
        "cut": (["--cut", "bogus"], "cut 'bogus' is not a layer of model 'nature'"),
        "resume dir": (["--resume", str(tmp_path / "nothing")], f"--resume {tmp_path / 'nothing'}: no such directory"),
    }


@pytest.mark.parametrize("case", ["env id", "run dir that is a file", "run dir under a file", "setting", "cut",
                                  "resume dir"])
def test_each_bad_input_is_one_line_before_any_stage_starts(tmp_path, launches, case):
    args, words = _bad_inputs(tmp_path)[case]
    run_dir = [] if "--run-dir" in args or "--resume" in args else ["--run-dir", str(tmp_path / "run")]
    result = splitrl_here("run", *TINY, *run_dir, *args, code=2)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and "Usage" not in result.output
    assert launches == [] and not (tmp_path / "run").exists()


def test_several_bad_inputs_are_one_line_each_at_once(tmp_path, launches):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    result = splitrl_here("run", *TINY, "--num-envs", "0", "--cut", "bogus", "--run-dir", str(tmp_path / "run"),
                          code=2)
    lines = result.stderr.splitlines()
    assert lines[0] == "error: invalid settings:" and len(lines) == 3 and launches == []
    for words in ("--num-envs", "cut 'bogus'"):
        assert sum(words in line for line in lines) == 1
    # The env id and the run directory are told first, together, before torch loads (below)
    result = splitrl_here("run", *TINY, "--num-envs", "0", "--env-id", "NoSuchEnv-v0", "--run-dir", str(a_file),
                          code=2)
    lines = result.stderr.splitlines()
    assert lines[0] == "error: invalid settings:" and len(lines) == 3 and launches == []
    for words in ("--env-id 'NoSuchEnv-v0'", "is a file"):
        assert sum(words in line for line in lines) == 1


@pytest.mark.parametrize("case", ["env id", "run dir that is a file", "resume dir"])
def test_a_wrong_env_id_or_run_directory_is_told_before_torch_loads(tmp_path, case):
    """These are told in a fraction of a second: the launcher checks them before it imports torch (1.5-4 s of
    a cold start on a loaded machine), and the rest of the check after."""
    import subprocess
    import sys

    args, words = _bad_inputs(tmp_path)[case]
    run_dir = [] if "--run-dir" in args or "--resume" in args else ["--run-dir", str(tmp_path / "run")]
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "splitrl", "run", *TINY, *run_dir, *args],
                          capture_output=True, text=True, timeout=120)
    imported = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    told = [line for line in done.stderr.splitlines() if not line.startswith("import time")]
    assert done.returncode == 2 and len(told) == 1 and words in told[0], done.stderr[-2000:]
    assert "click" in imported and "torch" not in imported


def test_a_bad_input_is_said_once_by_the_launcher_and_no_stage_starts(tmp_path, spawn):
    started = time.monotonic()
    code, out = spawn("run", *TINY, "--env-id", "NoSuchEnv-v0", "--run-dir", str(tmp_path / "run")).finish(timeout=120)
    elapsed = time.monotonic() - started
    assert code == 2 and out.count("\n") == 1 and out.startswith("error: --env-id 'NoSuchEnv-v0'"), out
    # No stage ran (one would log, and the launcher names the run directory after it): no 10-15 s of stages
    # starting torch and the env twice. Bounded, not timed: Python and torch start-up alone can take 40 s on two
    # loaded cores.
    assert not (tmp_path / "run").exists() and elapsed < 120


def test_a_problem_a_stage_finds_later_is_said_once_by_that_stage(tmp_path, spawn):
    """Stage1 fails in training (a user's layer), tells stage0, and says why; stage0, stopped by that abort,
    says nothing more."""
    code, out = spawn("run", "--env-id", "CartPole-v1", "--model", "tests.stages.refusing_model:factory",
                      "--cut", "fc1", "--num-steps", "16", "--total-steps", "32", "--epochs", "1", "--minibatches",
                      "1", "--threads", "1", "--run-dir", str(tmp_path / "run")).finish(timeout=240)
    assert code == 1, out
    assert out.count("refuses to train") == 1 and "error: this layer refuses to train" in out, out
    assert "Usage" not in out and "stage1 exit 1, stage0 exit 1" in out


def test_a_settings_error_is_one_line_and_a_supervised_stage_stopped_by_its_peer_says_nothing(monkeypatch):
    def settings():
        raise SettingsError("--seed must be >= 0, got -1")

    def aborted():
        raise PeerAbort("stage1 stopped: stage1 failed: RuntimeError: boom")

    import click

    @click.command()
    @click.argument("what")
    def cli(what):
        run_cli({"settings": settings, "aborted": aborted}[what])

    result = CliRunner().invoke(cli, ["settings"])
    assert result.exit_code == 2 and result.output == "error: --seed must be >= 0, got -1\n"
    monkeypatch.delenv(SUPERVISED_ENV, raising=False)
    result = CliRunner().invoke(cli, ["aborted"])  # on its own terminal: the peer's reason is news
    assert result.exit_code == 1 and result.output == "error: stage1 stopped: stage1 failed: RuntimeError: boom\n"
    monkeypatch.setenv(SUPERVISED_ENV, "1")
    result = CliRunner().invoke(cli, ["aborted"])
    assert result.exit_code == 1 and result.output == ""


def test_the_launcher_tells_its_stages_they_are_supervised(monkeypatch, tmp_path):
    envs = []

    class Ended:
        returncode = 0
        pid = 0

        def __init__(self, argv, env=None):
            envs.append(env)

        def poll(self):
            return 0

    monkeypatch.setattr(splitrl.launch.subprocess, "Popen", Ended)
    assert launch_split(["--run-dir", str(tmp_path)], str(tmp_path)) == 0
    assert len(envs) == 2 and all(env[SUPERVISED_ENV] == "1" for env in envs)
    assert SUPERVISED_ENV not in os.environ


@pytest.mark.parametrize("env_id", ["splitrl/PickByCue-v0", "CartPole", "gymnasium.envs.classic_control:CartPole-v1"])
def test_the_early_check_finds_an_env_as_making_it_would(env_id):
    """splitrl's own envs, an id without its version (the newest), a ``module:`` prefix (imported first)."""
    from splitrl.runner.precheck import env_id_problem
    from splitrl.settings import EnvSettings

    assert env_id_problem(EnvSettings(env_id=env_id)) is None
    assert "no_such_module" in env_id_problem(EnvSettings(env_id="no_such_module:Env-v0"))
