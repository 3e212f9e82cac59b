"""Stages forked from `splitrl run` (`preforked`): the launcher imports what a stage imports once, then forks a
process per stage, each of which becomes ``splitrl stage0|stage1 ARGS`` when `launch_split` sends its argv. A stage
process started fresh spends about 3 CPU-seconds importing torch and the optimiser's compiler stack before it does
any work; forked, it shares the launcher's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator, Sequence

import click

from ..launch import STOP_GRACE_S, SUPERVISED_ENV

__all__ = ["preload_stage", "preforked", "ForkedStage", "run_command", "leave"]


def preload_stage(env_id: str | None = None) -> None:
    """Import what a stage process imports before it does any work: torch, the compiler stack torch's optimisers
    import on their first step, gymnasium, ZeroMQ, the runner and, for ``env_id``, the module gymnasium registered
    it from. Nothing here runs in parallel, so no thread pool starts: a process forked after this (and after no
    more than one-threaded torch work) is sound."""
    import torch

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # never stepped: only its imports are wanted
    import torch._dynamo  # noqa: F401  (what the first Adam.step would import)
    import gymnasium
    import zmq  # noqa: F401

    from ..runner import build, stage0, stage1  # noqa: F401  (the package loads its modules lazily)

    if env_id:
        import importlib

        with contextlib.suppress(Exception):  # an env id gymnasium does not know is the stage's to report
            entry = gymnasium.spec(env_id).entry_point
            importlib.import_module(entry.split(":")[0])


class ForkedStage:
    """A process forked from the launcher that becomes ``splitrl ARGV`` when `start` sends its argv (or exits 0 at
    once when `abandon` closes the pipe first). It offers the part of `subprocess.Popen` that `supervise` uses:
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal`` and ``kill``.

    The child runs the `splitrl` command as the console script does (`run_command`, `SUPERVISED_ENV` set), with
    the logging of a fresh process, then leaves as an interpreter does, by ``os._exit``, so nothing of the
    launcher's own stack above the fork runs twice. What it shares with the launcher beyond the imports: the
    environment as the launcher's interpreter read it (``OMP_WAIT_POLICY``, which ``python -m splitrl`` sets
    before torch loads) and, in ``ps``, the launcher's command line."""

    _pipes: set[int] = set()
    """The write ends of the stages forked so far and not yet started: a child closes its siblings', or a
    sibling's pipe would never reach its end."""

    def __init__(self, command: click.Command) -> None:
        read, write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # A stop signal between the fork and the child's own handlers would raise in the launcher's frames,
        # which the child has a copy of: held until the child has set its own.
        stops = {signal.SIGINT, signal.SIGTERM}
        held = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            os.close(read)
            os.close(write)
            raise
        if pid == 0:  # pragma: no cover  (the child: its coverage is the stage's)
            try:
                # Until told what to be, a stop signal ends the child at once, quietly (the launcher stops too).
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
                for fd in (write, *ForkedStage._pipes):
                    os.close(fd)
                ForkedStage._pipes.clear()
                argv = _read_argv(read)
                if argv is None:
                    os._exit(0)
                os.environ[SUPERVISED_ENV] = "1"
                leave(run_command(command, argv))
            finally:
                os._exit(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.close(read)
        ForkedStage._pipes.add(write)
        self.pid, self.returncode, self.started = pid, None, False
        self._go: int | None = write

    def start(self, argv: Sequence[str]) -> None:
        """Become ``splitrl ARGV``. OSError when the child is gone (it was killed while it waited)."""
        data = json.dumps(list(argv)).encode()
        view = memoryview(data)
        while view:  # a pipe takes 64 KiB at once; an argv is a few kB
            view = view[os.write(self._go, view):]
        self.started = True
        self.abandon()

    def abandon(self) -> None:
        """Close the pipe: a child still waiting for its argv exits 0 without running anything."""
        if self._go is not None:
            ForkedStage._pipes.discard(self._go)
            os.close(self._go)
            self._go = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): what Popen says then
                self.returncode = 0
                return 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked stage {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _read_argv(go: int) -> list[str] | None:  # pragma: no cover  (runs in the forked child)
    chunks = []
    while chunk := os.read(go, 65536):
        chunks.append(chunk)
    os.close(go)
    return json.loads(b"".join(chunks)) if chunks else None


def run_command(command: click.Command, argv: Sequence[str]) -> int:
    """Run ``splitrl ARGV`` in this process as the console script does, ``command`` being the `splitrl` group
    (in a process forked for it: `ForkedStage`, and the tests' warm interpreter), with the logging of a fresh
    process; returns its exit status."""
    import logging

    for handler in logging.root.handlers[:]:  # the launcher's: the command sets up its own, as in a new process
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    sys.argv = ["splitrl", *argv]
    try:
        command.main(args=list(argv), prog_name="splitrl")
    except SystemExit as exc:  # how click's standalone mode always ends
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a stop before the command's own handlers: what an interpreter's exit says
        return 130
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    return 0


def leave(code: int) -> None:  # pragma: no cover  (ends a forked child)
    """Exit as an interpreter does, each step on its own (non-daemon threads joined, exit handlers run, output
    flushed), by ``os._exit``: nothing of the stack above runs."""
    import atexit

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def preforked(count: int, command: click.Command, env_id: str | None = None) -> Iterator[list[ForkedStage]]:
    """``count`` stages of ``command`` (the `splitrl` group) forked now, after `preload_stage`; each waits for
    `ForkedStage.start`. Those not started
    when the block ends exit at once and are reaped (killed if they have not after `STOP_GRACE_S`).

    This process must not have run torch on more than one thread (OpenMP's worker threads do not survive a fork:
    `splitrl run` checks on one thread, then forks), nor touched CUDA (a forked child cannot initialise it again:
    `splitrl run` does not fork for a stage on cuda)."""
    if count:
        preload_stage(env_id)
    stages: list[ForkedStage] = []
    try:
        for _ in range(count):
            stages.append(ForkedStage(command))
        yield stages
    finally:
        for stage in stages:
            stage.abandon()
        for stage in stages:
            if not stage.started:
                try:
                    stage.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    stage.kill()
                    stage.wait()
