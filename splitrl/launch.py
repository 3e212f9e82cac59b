"""Starting and stopping the stages' processes: free ports, the one-command local split."""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from .runs import default_run_dir

if TYPE_CHECKING:
    from .settings import RunOptions, TrainSettings

__all__ = ["free_port_pair", "launch_split"]

log = logging.getLogger(__name__)


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P such that P and P+1 were free a moment ago."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind((host, 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            try:
                b.bind((host, port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free pair of adjacent ports on loopback")


def launch_split(settings: TrainSettings, options: RunOptions, grace: float = 15.0, endpoint: str | None = None) -> int:
    """Start stage1 and stage0 as two processes over loopback; stop both on any exit path.

    ``endpoint``: where stage1 binds and stage0 connects (default: a free loopback tcp port pair).
    """
    settings.validate(options)
    if not options.run_dir:
        options = dataclasses.replace(options, run_dir=default_run_dir(settings.env.env_id))
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port_pair()}"
    base = [sys.executable, "-m", "splitrl"]
    args = settings.to_argv() + options.to_argv()
    procs = [
        subprocess.Popen(base + ["stage1", "--bind", endpoint] + args),
        subprocess.Popen(base + ["stage0", "--connect", endpoint] + args),
    ]
    try:
        deadline = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes) and deadline is None:
                deadline = time.monotonic() + grace  # one failed: the other should follow via abort
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        log.info("stopping both stages")
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    codes = [p.returncode for p in procs]
    log.info("run directory: %s (stage1 exit %s, stage0 exit %s)", options.run_dir, *codes)
    return next((c for c in codes if c), 0)
