import json
import os
import queue
import signal
import subprocess
import sys
import threading
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

# Torch in the workers and in every process they start computes on one core's share: workers whose OpenMP
# threads each take both cores, and spin between parallel regions (libgomp's default wait), spend about a third
# more CPU on the same tests and finish later. Set before anything imports torch; a command's `--threads` still
# sets its own count.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Tiny but complete: two iterations, truncations every 20 steps (bootstrapping is exercised).
TINY = [
    "--total-steps", "64", "--num-steps", "32", "--epochs", "2", "--minibatches", "2",
    "--max-episode-steps", "20", "--threads", "1", "--checkpoint-every", "1", "--hidden", "32",
]


def script(name: str):
    """``scripts/NAME.py`` as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def splitrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitrl", *args]


def splitrl_here(*args: str, code: int | None = 0):
    """``splitrl ARGS`` in this process (click's CliRunner): the command parses and runs as it does in its own
    process, without a fresh interpreter importing torch. The group's logging and signal setup is left out;
    the torch thread count a command sets (``--threads``) is put back after. Asserts the exit code ``code``
    (None: any) and returns click's Result (``exit_code``, ``stdout``, ``stderr``, ``output``)."""
    import traceback

    import torch
    from click.testing import CliRunner

    from splitrl.cli import main

    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(main.commands[args[0]], list(args[1:]))
    finally:
        torch.set_num_threads(threads)
    if code is not None and result.exit_code != code:
        detail = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info else ""
        raise AssertionError(f"splitrl {args[0]}: exit {result.exit_code}, not {code}:\n{result.output[-3000:]}\n{detail}")
    return result


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
        if self._out is not None:
            self._out.close()


WARM_COMMANDS = ("stage0", "stage1", "train", "run")
"""What `spawn` forks from the warm interpreter: a stage, the twin or the launcher is a process of its own whatever
starts it (the launcher then forks its stages itself, as it does from a fresh Python). The launcher's own tests
start it cold (``spawn(..., cold=True)``), as a user's shell does: its stages then carry its command line."""


@pytest.fixture
def spawn(tmp_path, request):
    """Start `splitrl` subprocesses; every one is killed in teardown. `WARM_COMMANDS` are forked from the warm
    interpreter unless ``cold``; the others start with a Python of their own."""
    procs: list[Proc] = []

    def start(*args: str, cold: bool = False) -> Proc:
        log = tmp_path / f"proc{len(procs)}-{args[0]}.log"
        proc = (WarmProc(args, log, request.getfixturevalue("_warm")) if args[0] in WARM_COMMANDS and not cold
                else Proc(args, log))
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.stop()


def train_in_process(*args: str):
    """``splitrl train ARGS...`` (the twin, one process whatever it runs) in this process (`splitrl_here`): the
    numbers a spawned one computes, without a Python and a torch of its own. Returns click's `Result`
    (``exit_code``, ``output``, ``stderr``); an exception that is not a clean exit is raised as it is."""
    result = splitrl_here("train", *args, code=None)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


class _Warm:
    """The warm interpreter of `tests.warm`, and the exit codes of the processes it forked."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(splitrl_cmd()[:1] + ["-m", "tests.warm"], env=child_env(), cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pids: queue.Queue[int] = queue.Queue()
        self.codes: dict[int, int] = {}
        self.ended = threading.Condition()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="warm", daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            message = json.loads(line)
            if "pid" in message:
                self.pids.put(message["pid"])
            else:
                with self.ended:
                    pid, code = message["exit"]
                    self.codes[pid] = code
                    self.ended.notify_all()

    def fork(self, args: tuple[str, ...], log: Path, setup: list[str] | None = None) -> int:
        """Fork ``splitrl ARGS`` (output to ``log``), after ``setup`` (``["MODULE:FUNCTION", ARG, ...]``, called in
        the forked process first); its pid."""
        request = {"args": list(args), "log": str(log), **({"setup": setup} if setup else {})}
        with self.lock:
            self.popen.stdin.write((json.dumps(request) + "\n").encode())
            self.popen.stdin.flush()
            return self.pids.get(timeout=120)

    def close(self) -> None:
        self.popen.stdin.close()
        self.popen.wait(30)


class _Forked:
    """A process `_Warm` forked, seen as the part of `subprocess.Popen` that `Proc` and the tests use."""

    def __init__(self, warm: _Warm, pid: int, args: tuple[str, ...]) -> None:
        self.warm, self.pid, self.args = warm, pid, args

    @property
    def returncode(self) -> int | None:
        return self.warm.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.warm.ended:
            if not self.warm.ended.wait_for(lambda: self.pid in self.warm.codes, timeout):
                raise subprocess.TimeoutExpired(list(self.args), timeout)
        return self.warm.codes[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmProc(Proc):
    """`Proc` for ``splitrl ARGS`` forked from the warm interpreter: a process of its own, without the imports."""

    def __init__(self, args: tuple[str, ...], log: Path, warm: _Warm, setup: list[str] | None = None) -> None:
        self.log, self._out = log, None
        log.touch()
        self.popen = _Forked(warm, warm.fork(args, log, setup), args)


@pytest.fixture(scope="session")
def _warm():
    warm = _Warm()
    yield warm
    warm.close()
