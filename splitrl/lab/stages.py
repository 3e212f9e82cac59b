"""The real ``splitrl stage1`` / ``splitrl stage0`` processes in a lab's two namespaces.

`stage_commands` is their command lines (with a ``--heartbeat`` a thin link's largest
message can cross, `heartbeat_for`), `spawn_stages` starts them, and `train_in_lab`
runs one training to the end with each stage's output beside its run directory.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from ..launch import STOP_GRACE_S, supervise
from ..netem.netns import STAGE1_ADDR, Lab
from ..plan import TCP_GOODPUT
from ..settings import RunOptions
from ..transport.zmq_transport import HEARTBEAT_TIMEOUT_SHARE

__all__ = ["DEFAULT_PORT", "LARGEST_MESSAGE", "option_value", "heartbeat_for", "stage_commands", "spawn_stages",
           "train_in_lab"]

DEFAULT_PORT = 5555
"""The lab's namespaces are new and empty, so a fixed port is always free there
(`splitrl.launch.free_port_pair` checks the host's loopback, which is not where the
stages listen)."""


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in a command line (the last one given), or None."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    return values[-1] if values else None


LARGEST_MESSAGE = 2 * 1024 * 1024
"""Bytes of the paper configuration's largest message: a minibatch of 128 x 4096 float32 features."""


def heartbeat_for(rate_bits: int | None, stage_args: Sequence[str] = ()) -> list[str]:
    """``--heartbeat`` for a link of ``rate_bits`` unless ``stage_args`` set one: long enough that one
    `LARGEST_MESSAGE` crosses within ZeroMQ's heartbeat timeout (`HEARTBEAT_TIMEOUT_SHARE` of it). ZeroMQ counts a
    message as traffic only once it has all arrived, so a PONG queued behind a message that takes longer than
    the timeout is missed and the connection dropped (measured: 2 Mbit/s with the default 5 s failed at the
    first 1 MiB minibatch)."""
    if not rate_bits or "--heartbeat" in stage_args:
        return []
    needed = LARGEST_MESSAGE * 8 / (rate_bits * TCP_GOODPUT) / HEARTBEAT_TIMEOUT_SHARE + 1.0
    return ["--heartbeat", f"{math.ceil(needed)}"] if needed > RunOptions().heartbeat else []


def stage_commands(stage_args: Sequence[str], port: int = DEFAULT_PORT,
                   connect_host: str = STAGE1_ADDR, rate_bits: int | None = None) -> dict[str, list[str]]:
    """``connect_host``: where stage0 connects (stage1's address, or the delay relay in stage0's namespace);
    ``rate_bits``: the lab's rate, for `heartbeat_for`."""
    base = [sys.executable, "-m", "splitrl"]
    stage_args = [*heartbeat_for(rate_bits, stage_args), *stage_args]
    # --insecure (last, over any --no-insecure in stage_args): the addresses are the lab's own namespaces,
    # which nothing else on the machine reaches.
    return {
        "stage1": base + ["stage1", "--bind", f"tcp://{STAGE1_ADDR}:{port}", *stage_args, "--insecure"],
        "stage0": base + ["stage0", "--connect", f"tcp://{connect_host}:{port}", *stage_args, "--insecure"],
    }


def spawn_stages(lab: Lab, stage_args: Sequence[str], port: int = DEFAULT_PORT,
                 log_dir: Path | None = None, connect_host: str = STAGE1_ADDR) -> dict[str, subprocess.Popen]:
    """stage1, then stage0, in their namespaces; their output to ``log_dir/<side>.log`` if given, else to ours.

    Run them to the end with `splitrl.launch.supervise`; the lab stops whatever is left when it goes down.
    """
    cmds = stage_commands(stage_args, port, connect_host, lab.shaping.rate)
    procs = {}
    for side in ("stage1", "stage0"):
        if log_dir is None:
            procs[side] = lab.spawn(side, cmds[side])
        else:
            with open(log_dir / f"{side}.log", "w") as out:  # the child has its own copy of the descriptor
                procs[side] = lab.spawn(side, cmds[side], stdout=out, stderr=subprocess.STDOUT)
    return procs


def _tail(path: Path, chars: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def train_in_lab(lab: Lab, args: Sequence[str], run_dir: Path, port: int, timeout: float) -> None:
    """Both stages in the lab's namespaces, output to stage0.log / stage1.log beside the run directory's files."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    procs = spawn_stages(lab, [*args, "--run-dir", str(run_dir)], port, log_dir=run_dir)
    supervise(list(procs.values()), grace=STOP_GRACE_S, timeout=timeout)
    codes = {side: p.poll() for side, p in procs.items()}
    if any(c != 0 for c in codes.values()):
        why = "timed out" if time.monotonic() - start > timeout else "failed"
        logs = {side: run_dir / f"{side}.log" for side in procs}
        details = "\n".join(f"--- {side} (exit {codes[side]}), {logs[side]}:\n{_tail(logs[side])}" for side in logs)
        raise RuntimeError(f"training in the lab {why} (stage1 exit {codes['stage1']}, stage0 exit "
                           f"{codes['stage0']}), run directory {run_dir}\n{details}")
