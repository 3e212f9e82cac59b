"""Starting and stopping processes: free ports, the supervision of a pair of stages, the one-command local split.

Supervision is written once (`supervise`) and used by every place that runs the
two stages as processes: `launch_split` (``splitrl run``), the lab
(`splitrl.lab`), the lab benchmark and the transport-swap benchmark.

``splitrl run`` hands `launch_split` stages it forked (`splitrl.cli.fork`) rather than have it start a fresh
interpreter for each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, Protocol, Sequence

__all__ = [
    "STOP_GRACE_S",
    "SUPERVISED_ENV",
    "free_port",
    "free_port_pair",
    "wait_for_exit",
    "stop_processes",
    "supervise",
    "launch_split",
    "Supervised",
    "Startable",
    "run_local",
    "progress",
]

log = logging.getLogger(__name__)

STOP_GRACE_S = 15.0
"""How long stopped (or abandoned) stages get to tell each other and exit before they are killed."""
_POLL_S = 0.1

SUPERVISED_ENV = "SPLITRL_SUPERVISED"
"""Set in the environment of the stages `launch_split` starts: their output shares the launcher's terminal, so a
stage stopped by its peer's abort leaves the reason to the peer that found it (`splitrl.cli.errors.run_cli`)."""


_PICK = random.SystemRandom()
"""Not the global generator: a run seeds that one, and two processes must not pick alike."""


PORT_RANGE_ENV = "SPLITRL_PORT_RANGE"
"""``LOW-HIGH``: where `free_port` picks (a firewall's opening; test workers that must not pick alike)."""


def _below_ephemeral() -> tuple[int, int] | None:
    """Ports under the kernel's ephemeral range (where outgoing connections take their local port): a port chosen
    there cannot be taken by a connection between our check and the stage's bind (an edge's outgoing
    connection may otherwise take the port stage1 is about to bind). None where the range is unknown or starts too low.
    `PORT_RANGE_ENV` narrows it."""
    wanted = os.environ.get(PORT_RANGE_ENV)
    if wanted:
        low_s, _, high_s = wanted.partition("-")
        try:
            low, high = int(low_s), int(high_s)
        except ValueError:
            low = high = 0
        if not 1024 <= low < high <= 65535:
            raise ValueError(f"{PORT_RANGE_ENV}={wanted!r}: expected LOW-HIGH, 1024 <= LOW < HIGH <= 65535")
        return low, high
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (10_000, low - 1) if low > 12_000 else None


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port P such that P .. P+count-1 were all free on ``host`` a moment ago (below the ephemeral range where
    the kernel has one)."""
    below = _below_ephemeral()
    for attempt in range(100):
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            if below is not None and attempt < 50:
                try:
                    first.bind((host, _PICK.randint(below[0], below[1] - count + 1)))
                except OSError:
                    continue
            else:
                first.bind((host, 0))
            port = first.getsockname()[1]
            if port + count - 1 > 65535:
                continue
            try:
                for offset in range(1, count):
                    held.enter_context(socket.socket()).bind((host, port + offset))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {count} free adjacent port(s) on {host}")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P such that P and P+1 were free a moment ago (a ZeroMQ link binds both)."""
    return free_port(host, count=2)


# -- progress ---------------------------------------------------------------------------


@contextlib.contextmanager
def progress(run_dir: str | os.PathLike, iterations: int, desc: str) -> Iterator[None]:
    """A progress bar (tqdm, on stderr; off when stderr is not a terminal) of a run that another process
    makes: its metrics.jsonl is polled for finished iterations while the body runs."""
    from pathlib import Path

    from tqdm import tqdm

    metrics = Path(run_dir) / "metrics.jsonl"
    bar = tqdm(total=iterations, desc=desc, unit="iter", disable=None, leave=True)
    done = threading.Event()

    def follow() -> None:
        while not done.wait(2.0):
            seen = metrics.read_text().count("\n") if metrics.exists() else 0
            bar.update(max(0, min(seen, iterations) - bar.n))

    thread = threading.Thread(target=follow, name="progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
        bar.close()


# -- supervision -----------------------------------------------------------------------


class Supervised(Protocol):
    """What `supervise` needs of a process: `subprocess.Popen`'s ``pid``, ``returncode``, ``poll``, ``wait`` and
    ``send_signal``."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class Startable(Supervised, Protocol):
    """A process already there that becomes ``splitrl ARGV`` when told (`splitrl.cli.fork.ForkedStage`)."""

    def start(self, argv: Sequence[str]) -> None: ...


def wait_for_exit(procs: Sequence[Supervised], *, grace: float, timeout: float | None = None) -> bool:
    """Until every process has exited: True. False when it gave up with some still running:
    ``grace`` seconds after one failed (a stage that fails tells its peer, which should follow),
    or after ``timeout`` seconds in all."""
    give_up = None if timeout is None else time.monotonic() + timeout
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return True
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if (give_up is not None and now > give_up) or (failed_at is not None and now > failed_at + grace):
            return False
        time.sleep(_POLL_S)


def _signal(proc: Supervised, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def stop_processes(
    procs: Sequence[Supervised],
    grace: float = STOP_GRACE_S,
    *,
    first_signal: int = signal.SIGTERM,
    group: bool = False,
) -> None:
    """``first_signal`` to every process still running, SIGKILL to those left after ``grace`` seconds.

    ``group``: signal each process's whole process group (it was started with
    ``start_new_session=True``), so what it started goes too.
    """
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal(p, first_signal, group)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in alive):
        time.sleep(0.05)
    for p in alive:
        if p.poll() is None:
            _signal(p, signal.SIGKILL, group)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


def supervise(
    procs: Sequence[Supervised],
    *,
    grace: float = STOP_GRACE_S,
    timeout: float | None = None,
    on_interrupt: Callable[[], None] | None = None,
    first_signal: int = signal.SIGTERM,
    group: bool = False,
) -> bool:
    """Run started processes to the end: `wait_for_exit`, then `stop_processes` on every way out.

    Returns True when all exited by themselves, False when what was left had to be
    stopped (a failed peer's partner did not follow within ``grace``, or ``timeout``
    passed). Ctrl-C / SIGTERM (KeyboardInterrupt) and any other exception stop
    them too and propagate; ``on_interrupt`` is called first (to say what happens).
    """
    try:
        return wait_for_exit(procs, grace=grace, timeout=timeout)
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        raise
    finally:
        stop_processes(procs, grace, first_signal=first_signal, group=group)


# -- the local split -------------------------------------------------------------------


def launch_split(stage_args: Sequence[str], run_dir: str, *, endpoint: str | None = None,
                 grace: float = STOP_GRACE_S, edges: int = 1, resume: bool = False, learners: int = 1,
                 forked: Sequence[Startable] = ()) -> int:
    """Start ``splitrl stage1`` and ``splitrl stage0`` as two processes over loopback; stop both on any exit path.

    ``stage_args`` go to both (the settings' argv, ``--run-dir run_dir`` included); ``endpoint``:
    where stage1 binds and stage0 connects (default: free loopback tcp ports). A fleet (``edges`` > 1)
    starts a stage0 per edge, edge k with ``--edge-id k`` and the run directory ``run_dir/edge-k`` (resumed
    from there with ``resume``). ``learners`` > 1: stage1 as that many learner processes, started by torchrun
    (``--standalone``: its rendezvous on a free local port). ``forked``: processes ready for this run, used
    in order (stage1 unless it is torchrun's, then each stage0) before any fresh process is started. Returns the
    first non-zero exit code, else 0.
    """
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port(count=2 * edges)}"
    base = [sys.executable, "-m", "splitrl"]
    edge_args: list[list[str]] = [[]]
    if edges > 1:
        edge_args = []
        for k in range(edges):
            edge_dir = os.path.join(run_dir, f"edge-{k}")
            edge_args.append(["--edge-id", str(k), "--run-dir", edge_dir, *(["--resume", edge_dir] if resume else [])])
    learner = base if learners == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node", str(learners), "-m", "splitrl"]
    env = {**os.environ, SUPERVISED_ENV: "1"}
    spare = list(forked)

    def start(command: list[str], argv: list[str], forkable: bool = True) -> Startable | subprocess.Popen:
        if forkable and spare:
            stage = spare.pop(0)
            stage.start(argv)
            return stage
        return subprocess.Popen(command + argv, env=env)

    procs: list[Supervised] = []
    try:
        procs.append(start(learner, ["stage1", "--bind", endpoint, *stage_args], forkable=learners == 1))
        procs += [start(base, ["stage0", "--connect", endpoint, *stage_args, *extra]) for extra in edge_args]
    except BaseException:  # one failed to start (a forked stage gone, no python): those started stop too
        stop_processes(procs, grace)
        raise
    with contextlib.suppress(KeyboardInterrupt):  # all are stopped either way; their exit codes say how
        supervise(procs, grace=grace, on_interrupt=lambda: log.info(
            "stopping both stages" if edges == 1 else f"stopping stage1 and the {edges} edges"))
    codes = [p.returncode for p in procs]
    log.info("run directory: %s (stage1 exit %s, stage0 exit %s)", run_dir, codes[0], ", ".join(map(str, codes[1:])))
    return next((c for c in codes if c), 0)


def run_local(args: Sequence[str], run_dir: str | os.PathLike, timeout: float, command: str = "run") -> None:
    """``splitrl run --run-dir RUN_DIR ARGS`` to the end (or another ``command`` taking a run directory: ``train``,
    the twin), in a process group of its own (stopped as a whole on any way out, Ctrl-C first), its output in
    ``RUN_DIR.log`` beside the run; RuntimeError if it fails."""
    from pathlib import Path

    run_dir = Path(run_dir)
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "splitrl", command, "--run-dir", str(run_dir), *args],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        supervise([proc], grace=15.0, timeout=timeout, first_signal=signal.SIGINT, group=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir.name} failed (exit {proc.returncode}); its output: {log_path}")
