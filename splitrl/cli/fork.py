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

from ..launch import STOP_GRACE_S, SUPERVISED_ENV

__all__ = ["preload_stage", "preforked", "ForkedStage"]


def preload_stage(entry_point: str | None = None) -> None:
    """Import what a stage process imports before it does any work: torch, the compiler stack torch's optimisers
    import on their first step, gymnasium, ZeroMQ and the runner; ``entry_point`` (a gymnasium env's
    ``module:Class``): that env's module too, where it imports. Nothing here runs in parallel, so no thread pool
    starts: a process forked after this (and after no more than one-threaded torch work) is sound."""
    import torch

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # never stepped: only its imports are wanted
    import torch._dynamo  # noqa: F401  (what the first Adam.step would import)
    import gymnasium  # noqa: F401
    import zmq  # noqa: F401

    from .. import runner  # noqa: F401

    if entry_point and isinstance(entry_point, str) and ":" in entry_point:
        import importlib

        with contextlib.suppress(Exception):  # the env's own errors are the stage's to report
            importlib.import_module(entry_point.split(":")[0])


class ForkedStage:
    """A process forked from the launcher that becomes ``splitrl ARGV`` when `start` sends its argv (or exits 0 at
    once when `abandon` closes the pipe first). It offers the part of `subprocess.Popen` that `supervise` uses:
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal`` and ``kill``.

    The child runs ``python -m splitrl ARGV`` as a fresh interpreter would (`SUPERVISED_ENV` set),
    then leaves as an interpreter does (non-daemon threads joined, exit handlers run, output flushed) by
    ``os._exit``, so nothing of the launcher's own stack above the fork runs twice. Its command line in ``ps`` is
    the launcher's."""

    _pipes: set[int] = set()
    """The write ends of the stages forked so far and not yet started: a child closes its siblings', or a
    sibling's pipe would never reach its end."""

    def __init__(self) -> None:
        read, write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover  (the child: its coverage is the stage's)
            for fd in (write, *ForkedStage._pipes):
                os.close(fd)
            ForkedStage._pipes.clear()
            _become_stage(read)
        os.close(read)
        ForkedStage._pipes.add(write)
        self.pid, self.returncode, self.started = pid, None, False
        self._go: int | None = write

    def start(self, argv: Sequence[str]) -> None:
        """Become ``splitrl ARGV`` (the whole argv in one write: a pipe holds 64 KiB; an argv is a few kB)."""
        data = json.dumps(list(argv)).encode()
        os.write(self._go, data)
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
            pid, status = os.waitpid(self.pid, os.WNOHANG)
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


def _become_stage(go: int) -> None:  # pragma: no cover  (runs in the forked child)
    """The forked child: wait for the argv, run it as the `splitrl` command, exit with its status."""
    import atexit
    import traceback

    code = 1
    try:
        # Until told what to be, a stop signal ends the child at once, quietly (the launcher is stopping too).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        chunks = []
        while chunk := os.read(go, 65536):
            chunks.append(chunk)
        os.close(go)
        if not chunks:
            os._exit(0)
        argv = json.loads(b"".join(chunks))
        os.environ[SUPERVISED_ENV] = "1"
        sys.argv = ["splitrl", *argv]
        import runpy

        try:
            runpy.run_module("splitrl", run_name="__main__", alter_sys=True)  # as ``python -m splitrl ARGV``
            code = 0
        except SystemExit as exc:  # how click's standalone mode always ends
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  (as an interpreter's exit joins them)
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def preforked(count: int, entry_point: str | None = None) -> Iterator[list[ForkedStage]]:
    """``count`` stages forked now, after `preload_stage`; each waits for `ForkedStage.start`. Those not started
    when the block ends exit at once and are reaped. This process must not have run torch on more than one
    thread: OpenMP's worker threads do not survive a fork (`splitrl run` checks on one thread, then forks)."""
    preload_stage(entry_point)
    stages: list[ForkedStage] = []
    try:
        for _ in range(count):
            stages.append(ForkedStage())
        yield stages
    finally:
        for stage in stages:
            stage.abandon()
        for stage in stages:
            if not stage.started:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    stage.wait(STOP_GRACE_S)
