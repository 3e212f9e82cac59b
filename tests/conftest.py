import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each pytest-xdist worker picks free ports (here and in the stages it starts) from its own slice of 10000-32767:
# two workers checking the same port free a moment apart, then both binding it, failed CI once.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _worker, _workers = int(os.environ["PYTEST_XDIST_WORKER"][2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    _width = (32_767 - 10_000) // max(_workers, 1)
    os.environ.setdefault("SPLITRL_PORT_RANGE", f"{10_000 + _worker * _width}-{10_000 + (_worker + 1) * _width - 1}")

# Tiny but complete: two iterations, truncations every 20 steps (bootstrapping is exercised).
TINY = [
    "--total-steps", "64", "--num-steps", "32", "--epochs", "2", "--minibatches", "2",
    "--max-episode-steps", "20", "--threads", "1", "--checkpoint-every", "1",
]


def splitrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitrl", *args]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


class Proc:
    """A `splitrl` subprocess whose output goes to a file, so it can be read while it runs."""

    def __init__(self, args: tuple[str, ...], log: Path) -> None:
        self.log = log
        self._out = open(log, "w")
        self.popen = subprocess.Popen(splitrl_cmd(*args), env=child_env(), stdout=self._out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not seen; output so far:\n{self.output()}")
            time.sleep(0.1)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait for the exit (killing it after ``timeout``) and return (code, output)."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            raise AssertionError(f"still running after {timeout} s; output:\n{self.output()}") from None
        return self.popen.returncode, self.output()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self._out.close()


@pytest.fixture
def spawn(tmp_path):
    """Start `splitrl` subprocesses; every one is killed in teardown."""
    procs: list[Proc] = []

    def start(*args: str) -> Proc:
        proc = Proc(args, tmp_path / f"proc{len(procs)}-{args[0]}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.stop()


def train_in_process(*args: str):
    """``splitrl train ARGS...`` (the twin, one process whatever it runs) in this process, through click: the
    numbers a spawned one computes, without a Python and a torch of its own. Returns click's `Result`
    (``exit_code``, ``output``, ``stderr``); an exception that is not a clean exit is raised as it is."""
    from click.testing import CliRunner

    from splitrl.cli.train import train

    return CliRunner().invoke(train, list(args), prog_name="splitrl train", catch_exceptions=False)
