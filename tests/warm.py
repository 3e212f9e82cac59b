"""A warm interpreter that starts `splitrl` processes by forking (the tests' `spawn` fixture: the stages, the twin
and the launcher; the hostile edges of tests/schedule/test_fleet_hostile.py).

``python -m tests.warm`` imports what every stage process imports (`splitrl.cli.fork.preload_stage`, as
``splitrl run`` does before it forks its stages), then reads requests on stdin, one JSON line each:
``{"args": [...], "log": PATH}``, and optionally ``"setup": ["MODULE:FUNCTION", ARG, ...]``, a function the
forked process calls with those arguments first (a test's alteration of the stage, as `tests.hostile.edge` makes).
For each it forks a process that runs ``python -m splitrl ARGS`` from there
(its own process, its own sockets and signal handlers, the same entry point and exit as `splitrl run`'s stages), its
output to PATH. It answers on stdout ``{"pid": N}`` for each request and ``{"exit": [N, CODE]}`` when one
ends (CODE as `subprocess` gives it: negative when a signal killed it). A stage process spends most of its
CPU time importing; forked from here it does not. Nothing runs in the warm process but imports, so no
thread pool is forked. It ends when its stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

__all__: list[str] = []


def _say(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # one write: a reply never splits


def _reap(signum: int, frame: Any) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exit": [pid, os.waitstatus_to_exitcode(status)]})


def _preload() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what splitrl's __main__ sets before torch loads
    import splitrl.cli  # noqa: F401
    from splitrl.cli.fork import preload_stage

    preload_stage("CarRacing-v3")  # what `splitrl run` does before it forks its stages


def _serve() -> dict[str, Any]:
    """Fork a process per request; in the forked process, return its request (the loop is the warm one's)."""
    signal.signal(signal.SIGCHLD, _reap)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return request
        _say({"pid": pid})
    sys.exit(0)


def _run(request: dict[str, Any]) -> None:
    """Be ``splitrl ARGS`` (as `splitrl run`'s forked stages are: `splitrl.cli.fork.run_command`) with stdout and
    stderr to the request's log and stdin from /dev/null."""
    from splitrl.cli import main
    from splitrl.cli.fork import leave, run_command

    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if request.get("setup"):
        import importlib
        import traceback

        target, *args = request["setup"]
        try:
            module, function = target.split(":")
            getattr(importlib.import_module(module), function)(*args)
        except BaseException:  # said in the log; the process leaves as a stage does, not through the warm one's exit
            traceback.print_exc()
            leave(1)
    leave(run_command(main, request["args"]))


if __name__ == "__main__":
    _preload()
    _run(_serve())
