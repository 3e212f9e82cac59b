"""Network namespaces: two joined by a shaped veth pair (`Lab`), or one with only its loopback (`LoopbackNamespace`).

Shaping loopback would slow every local process and tell nothing about a real
link: loopback has a 64 KiB MTU, no Ethernet header and no queue. A `Lab`
instead gives each end its own network stack (``ip netns``), joins them with a
veth pair (a virtual Ethernet cable, 1500 MTU) and shapes the egress of each end
with `splitrl.netem.tc`, so both directions see the same link. Processes started
with `Lab.spawn` run inside one end. The addresses live only inside the two
namespaces, so nothing on the host's own interfaces, routes or ports is touched,
and `Lab.down` removes it all again: deleting a namespace deletes its veth end.

This module knows namespaces, interfaces and processes, not what runs in them;
the lab's training runs are `splitrl.lab`. The two ends are called
``stage0`` and ``stage1`` because that is what they carry.

Kernel counters. Each veth end counts what the kernel sent (`Lab.counters`,
``rtnl_link_stats64``: the same numbers as /sys/class/net/DEV/statistics). Per
packet they include an Ethernet header (14), IPv4 (20), TCP (20) and TCP's
timestamp option (12): 66 bytes (`Lab.header_bytes`), about 4.6 % of a full
1448-byte segment, and all of an ACK. Subtracting ``tx_packets x 66`` is only
exact if one packet is one TCP segment, but veth offloads segmentation
(GSO/TSO): TCP hands it 64 KiB super-packets and ``tx_packets`` counts those,
not segments. There is no ethtool on every machine, so `setup_commands` sets
``gso_max_segs 1`` on both ends with ``ip link``, which makes TCP build
one-segment packets; at lab rates the extra per-packet work is negligible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ..launch import STOP_GRACE_S, stop_processes
from .tc import (Applied, NetemMissing, PartialShaping, Plan, Runner, ShapingError, Shaping, apply_shaping, format_plan,
                 plan_shaping, run_command)

__all__ = [
    "Lab",
    "LabNames",
    "Counters",
    "LoopbackNamespace",
    "SIDES",
    "NS_PREFIX",
    "STAGE0_ADDR",
    "STAGE1_ADDR",
    "setup_commands",
    "teardown_commands",
    "format_lab_plan",
    "lab_namespaces",
    "delete_namespace",
    "exec_argv",
    "interface_counters",
    "sysfs_tx_counters",
    "netns_available",
]

log = logging.getLogger(__name__)

NS_PREFIX = "splitrl-"
"""Every namespace the lab creates is named ``splitrl-s0-<hex>`` / ``splitrl-s1-<hex>``."""
STAGE1_ADDR = "10.213.0.1"
STAGE0_ADDR = "10.213.0.2"
PREFIX_LEN = 30
"""A /30 of 10.213.0.0/16 for the two veth ends. It exists only inside the lab's
namespaces (the host's routing table never sees it), so it cannot clash with the
host's networks; an unusual block just keeps the lab's addresses recognisable."""
ETH_IP_TCP_BYTES = 14 + 20 + 20
"""Ethernet + IPv4 + TCP headers without options (veth frames carry no FCS)."""
TCP_TIMESTAMP_BYTES = 12
"""The timestamp option (10 bytes, padded to 12) on every segment after the SYNs when enabled."""

SIDES = ("stage0", "stage1")
ADDRESSES = {"stage0": STAGE0_ADDR, "stage1": STAGE1_ADDR}


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _child_env() -> dict[str, str]:
    """The environment of processes started in the namespaces: ours, with this splitrl importable."""
    env = dict(os.environ)
    root = _package_root()
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root] + parts)
    return env


# -- names and commands (pure) ---------------------------------------------------------


@dataclass(frozen=True)
class LabNames:
    """Namespace and interface names of one lab; the random tag keeps concurrent labs apart."""

    tag: str

    @classmethod
    def random(cls) -> "LabNames":
        return cls(secrets.token_hex(3))

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{1,8}", self.tag):
            raise ValueError(f"lab tag must be 1-8 lowercase hex digits, got {self.tag!r}")

    def ns(self, side: str) -> str:
        return f"{NS_PREFIX}{_side(side)}-{self.tag}"

    def dev(self, side: str) -> str:
        return f"{_side(side)}-{self.tag}"  # at most 11 characters: interface names stop at 15

    @property
    def namespaces(self) -> tuple[str, str]:
        return self.ns("stage1"), self.ns("stage0")


def _side(side: str) -> str:
    short = {"stage0": "s0", "stage1": "s1"}.get(side)
    if short is None:
        raise ValueError(f"side must be 'stage0' or 'stage1', got {side!r}")
    return short


def exec_argv(ns: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def setup_commands(names: LabNames) -> list[list[str]]:
    """Namespaces, the veth pair created directly inside them, addresses, links up. Pure.

    The veth ends are created inside their namespaces (``netns`` on ``ip link
    add``), so they never exist in the host's namespace even for a moment.
    ``addrgenmode none`` gives them no IPv6 link-local address, so the kernel sends
    no IPv6 neighbour discovery or router solicitations of its own on the link:
    the interface counters see only the stages' traffic (and ARP).
    ``gso_max_segs 1``: see the module docstring (one packet = one TCP segment).
    """
    n0, n1 = names.ns("stage0"), names.ns("stage1")
    d0, d1 = names.dev("stage0"), names.dev("stage1")
    cmds = [["ip", "netns", "add", n1], ["ip", "netns", "add", n0]]
    cmds.append(["ip", "link", "add", d0, "netns", n0, "type", "veth", "peer", "name", d1, "netns", n1])
    for side in ("stage1", "stage0"):
        ns, dev = names.ns(side), names.dev(side)
        cmds += [
            ["ip", "-n", ns, "link", "set", "dev", dev, "addrgenmode", "none", "gso_max_segs", "1"],
            ["ip", "-n", ns, "addr", "add", f"{ADDRESSES[side]}/{PREFIX_LEN}", "dev", dev],
            ["ip", "-n", ns, "link", "set", "dev", "lo", "up"],
            ["ip", "-n", ns, "link", "set", "dev", dev, "up"],
        ]
    return cmds


def teardown_commands(names: LabNames) -> list[list[str]]:
    """Deleting a namespace deletes the veth end in it, and with it the pair and their qdiscs."""
    return [["ip", "netns", "delete", ns] for ns in names.namespaces]


def format_lab_plan(names: LabNames, shaping: Shaping, commands: Mapping[str, Sequence[str]] | None = None) -> str:
    """The dry-run text: every command a lab would run, in order, with ``commands`` (side -> argv) inside. Pure."""
    lines = ["# namespaces and the veth pair"] + [shlex.join(c) for c in setup_commands(names)]
    for side in ("stage1", "stage0"):
        lines.append(f"# shaping of {side}'s egress")
        lines.append(format_plan(plan_shaping(names.dev(side), shaping, names.ns(side))))
    for side, cmd in (commands or {}).items():
        lines.append(f"# {side}")
        lines.append(shlex.join(exec_argv(names.ns(side), cmd)))
    lines.append("# on exit (normal end, failure or Ctrl-C)")
    lines += [shlex.join(c) for c in teardown_commands(names)]
    return "\n".join(lines)


# -- namespaces on this machine --------------------------------------------------------


def lab_namespaces(run: Runner | None = None) -> list[str]:
    """Namespaces whose names say a splitrl lab made them (``ip netns list``)."""
    out = (run or run_command)(["ip", "netns", "list"])
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(rf"{NS_PREFIX}s[01]-[0-9a-f]+", n)]


def delete_namespace(ns: str, run: Runner | None = None) -> None:
    """Kill everything still running in ``ns``, then delete it. Raises `ShapingError` unless it is gone.

    A process left inside keeps the namespace (and its veth end) alive after
    ``ip netns delete``; everything in a splitrl namespace is splitrl's.
    """
    run = run or run_command
    with contextlib.suppress(ShapingError):
        for pid in run(["ip", "netns", "pids", ns]).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    try:
        run(["ip", "netns", "delete", ns])
    except ShapingError as exc:
        if "No such file" not in str(exc):
            raise


@dataclass(frozen=True)
class Counters:
    """One interface's kernel counters (``rtnl_link_stats64``, the same as /sys/class/net/DEV/statistics)."""

    tx_bytes: int = 0
    tx_packets: int = 0
    rx_bytes: int = 0
    rx_packets: int = 0

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))


def interface_counters(ns: str, dev: str, run: Runner | None = None) -> Counters:
    """The counters of ``dev`` in namespace ``ns``."""
    out = (run or run_command)(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev])
    stats = json.loads(out)[0]["stats64"]
    return Counters(stats["tx"]["bytes"], stats["tx"]["packets"], stats["rx"]["bytes"], stats["rx"]["packets"])


def sysfs_tx_counters(dev: str) -> tuple[int, int]:
    """(tx_bytes, tx_packets) of ``dev`` in this process's own namespace, from sysfs: cheap enough to time around."""
    base = Path("/sys/class/net") / dev / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "tx_packets").read_text())


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while cleaning up, so a second Ctrl-C cannot leave namespaces behind.

    A signal that arrived meanwhile is delivered as KeyboardInterrupt afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def note(signum: int, frame: Any) -> None:
        caught.append(signum)

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if caught:
        raise KeyboardInterrupt(signal.Signals(caught[0]).name)


# -- two namespaces and a shaped veth pair ---------------------------------------------

RELAY_HOST = "127.0.0.1"
"""Where the delay relay listens inside stage0's namespace (its own loopback)."""


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> bool:
    """Read ``proc``'s (text) stdout until a line contains ``text``; False if it ends or the time runs out.

    The reader goes on draining the pipe afterwards (into our debug log), so a chatty process
    never blocks on a full pipe."""
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if found.is_set():
                log.debug("%s", line.rstrip())
            elif text in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout)


class Lab:
    """Two namespaces joined by a veth pair, each end's egress shaped alike.

    Use as a context manager: leaving it by any path (normal end, exception,
    KeyboardInterrupt from Ctrl-C or SIGTERM) stops every process started with
    `spawn`, kills anything else still inside the namespaces, and deletes them.
    """

    def __init__(
        self,
        shaping: Shaping,
        *,
        allow_partial: bool = False,
        names: LabNames | None = None,
        run: Runner | None = None,
    ) -> None:
        self.shaping = shaping.validate()
        self.allow_partial = allow_partial
        self.names = names or LabNames.random()
        self.run = run or run_command
        self.applied: list[Applied] = []
        self.procs: list[subprocess.Popen] = []
        self.relay_delay: tuple[float, float] | None = None
        """(delay, jitter) in seconds that `start_relay` adds, where the kernel has no netem to do it."""
        self._up = False

    def __enter__(self) -> "Lab":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def ns(self, side: str) -> str:
        return self.names.ns(side)

    def dev(self, side: str) -> str:
        return self.names.dev(side)

    def up(self) -> None:
        """Create and shape the link. On failure, the caller must call `down` (``with`` does)."""
        self._up = True
        for cmd in setup_commands(self.names):
            self.run(cmd)
        for side in ("stage1", "stage0"):
            plan = plan_shaping(self.dev(side), self.shaping, self.ns(side))
            self.applied.append(self._apply(plan))
        log.info("lab %s up: %s", self.names.tag, "; ".join(a.summary() for a in self.applied))

    def _apply(self, plan: Plan) -> Applied:
        """netem; without it, tbf for the rate and, for delay and jitter, the TCP relay (`splitrl.netem.relay`)."""
        try:
            return apply_shaping(plan, allow_partial=self.allow_partial, run=self.run)
        except (PartialShaping, NetemMissing):
            lost = [what for what in plan.tbf_cannot if not what.startswith(("delay", "jitter"))]
            if not self.shaping.delay or (lost and not self.allow_partial):
                raise
        self.relay_delay = (self.shaping.delay, self.shaping.jitter)
        note = ("the kernel has no netem qdisc: the delay (and jitter) come from a TCP relay in stage0's namespace "
                "(splitrl.netem.relay), per chunk and in order, TCP only")
        if plan.tbf:
            applied = apply_shaping(plan, allow_partial=True, run=self.run)
            return dataclasses.replace(applied, not_applied=tuple(lost), notes=applied.notes + (note,))
        return Applied(plan.dev, "relay", "no qdisc", [], not_applied=tuple(lost), notes=(note,))

    def start_relay(self, ports: Sequence[int], timeout: float = 60.0) -> str:
        """With `relay_delay`: a relay in stage0's namespace from 127.0.0.1:PORT to stage1's address for each
        port; returns the host stage0 should connect to (stage1's address when there is no relay)."""
        if self.relay_delay is None:
            return ADDRESSES["stage1"]
        delay, jitter = self.relay_delay
        argv = [sys.executable, "-m", "splitrl.netem.relay", "--listen", f"{RELAY_HOST}:{','.join(map(str, ports))}",
                "--to", ADDRESSES["stage1"], "--delay", f"{delay * 1e3:g}ms", "--jitter", f"{jitter * 1e3:g}ms"]
        proc = self.spawn("stage0", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = wait_for_line(proc, "relay ready", timeout)
        if not ready:
            raise ShapingError(f"the delay relay did not start within {timeout:g} s (exit {proc.poll()})")
        return RELAY_HOST

    def spawn(self, side: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``side``'s namespace; `down` stops it."""
        popen_kwargs.setdefault("env", _child_env())
        proc = subprocess.Popen(exec_argv(self.ns(side), argv), **popen_kwargs)
        self.procs.append(proc)
        return proc

    def exec_text(self, side: str, argv: Sequence[str]) -> str:
        return self.run(exec_argv(self.ns(side), argv))

    def counters(self, side: str) -> Counters:
        return interface_counters(self.ns(side), self.dev(side), self.run)

    def tcp_stats(self, side: str) -> dict[str, int]:
        """The namespace's TCP MIB counters (/proc/net/snmp, ``Tcp:`` lines): OutSegs, RetransSegs, ..."""
        text = self.exec_text(side, ["cat", "/proc/net/snmp"])
        lines = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
        if len(lines) < 2:
            return {}
        return {k: int(v) for k, v in zip(lines[0], lines[1])}

    def header_bytes(self) -> int:
        """Link + IP + TCP header bytes per packet: 66 with TCP timestamps on at both ends, else 54."""
        on = all(self.exec_text(s, ["cat", "/proc/sys/net/ipv4/tcp_timestamps"]).strip() != "0" for s in SIDES)
        return ETH_IP_TCP_BYTES + (TCP_TIMESTAMP_BYTES if on else 0)

    def stop_processes(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to every spawned process still running, SIGKILL after ``grace`` seconds."""
        stop_processes(self.procs, grace)

    def down(self, grace: float = STOP_GRACE_S) -> None:
        """Stop processes, delete both namespaces. Never raises for what is already gone."""
        if not self._up:
            return
        with _signals_deferred():
            self.stop_processes(grace)
            problems = []
            for ns in self.names.namespaces:
                try:
                    delete_namespace(ns, self.run)
                except ShapingError as exc:
                    problems.append(str(exc))
            self._up = False
            left = [ns for ns in self.names.namespaces if ns in _safe_list(self.run)]
            if left or problems:
                log.warning(
                    "lab cleanup incomplete (%s); remove by hand: %s",
                    "; ".join(problems) or "still listed", " ; ".join(f"ip netns delete {ns}" for ns in left),
                )


def _safe_list(run: Runner) -> list[str]:
    try:
        return lab_namespaces(run)
    except ShapingError:
        return []


# -- one private namespace -------------------------------------------------------------


class LoopbackNamespace:
    """A private network namespace with only its loopback up; removed on exit.

    What runs inside (`wrap`) has a loopback of its own that nothing else uses,
    so `lo_bytes` counts exactly its TCP traffic, headers and acks included.
    """

    def __init__(self, run: Runner | None = None) -> None:
        self.name = f"{NS_PREFIX}swap-{uuid.uuid4().hex[:8]}"
        self.run = run or run_command

    def __enter__(self) -> "LoopbackNamespace":
        self.run(["ip", "netns", "add", self.name])
        try:
            self.run(["ip", "-n", self.name, "link", "set", "lo", "up"])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            delete_namespace(self.name, self.run)
        except ShapingError as exc:
            log.warning("could not remove network namespace %s: %s", self.name, exc)

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return exec_argv(self.name, argv)

    def lo_bytes(self) -> int:
        return interface_counters(self.name, "lo", self.run).tx_bytes


@functools.lru_cache(maxsize=1)
def netns_available() -> bool:
    """Whether this process can create (and remove) a network namespace: tried once."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip")):
        return False
    try:
        with LoopbackNamespace():
            return True
    except ShapingError:
        return False
