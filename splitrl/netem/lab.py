"""The two-host lab on one machine: stage0 and stage1 in two network namespaces joined by a shaped veth pair.

Shaping loopback would slow every local process and tell nothing about a real
link: loopback has a 64 KiB MTU, no Ethernet header and no queue. The lab instead
gives each stage its own network stack (``ip netns``), joins them with a veth
pair (a virtual Ethernet cable, 1500 MTU), shapes the egress of each end with
`splitrl.netem.tc` so both directions see the same link, and runs the real
``splitrl stage1`` / ``splitrl stage0`` processes inside with any training
settings. The addresses live only inside the two namespaces, so nothing on the
host's own interfaces, routes or ports is touched, and `Lab.down` removes it all
again: deleting a namespace deletes its veth end.

Byte accounting. Each veth end counts what the kernel sent
(``/sys/class/net/DEV/statistics/tx_bytes``, ``tx_packets``); the stages'
meters count frame payloads (docs/PROTOCOL.md section 9). The kernel's bytes
include per packet an Ethernet header (14), IPv4 (20), TCP (20) and TCP's
timestamp option (12): 66 bytes, about 4.6 % of a full 1448-byte segment, and
all of an ACK. The lab therefore reports both the raw ratio and the ratio after
subtracting ``tx_packets x 66``. That correction is only exact if one packet is
one TCP segment, but veth offloads segmentation (GSO/TSO): TCP hands it 64 KiB
super-packets and ``tx_packets`` counts those, not segments. There is no ethtool
on every machine (there is none on the one this was written on), so the lab sets
``gso_max_segs 1`` on both ends with ``ip link``, which makes TCP build
one-segment packets; at lab rates the extra per-packet work is negligible. What
remains after the correction is named in the report: ZeroMQ's own framing (a
64-byte greeting and a READY command per connection, 2 bytes per frame up to
255 bytes, 9 above), SYN options (+8 bytes each), ARP (-24 each) and
retransmitted segments.

Throughput. Before training, `measure_throughput` sends 1 MiB messages through
the project's own `ZmqTransport` from the stage0 namespace to the stage1 one and
times them until the receiver acknowledges the last: application bytes per
second (goodput), beside the wire rate from the same kernel counters. At
20 Mbit/s goodput is at most 20 x 1448 / 1514 = 19.1 Mbit/s: tc's rate counts
the Ethernet and IP/TCP headers too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from .tc import (
    MSS_BYTES,
    Applied,
    Runner,
    ShapingError,
    Shaping,
    apply_shaping,
    format_plan,
    format_rate,
    format_size,
    plan_shaping,
    run_command,
)

__all__ = [
    "Lab",
    "LabNames",
    "LabResult",
    "Throughput",
    "SideBytes",
    "setup_commands",
    "teardown_commands",
    "lab_namespaces",
    "measure_throughput",
    "run_lab",
    "format_report",
    "format_lab_plan",
    "NS_PREFIX",
    "STAGE0_ADDR",
    "STAGE1_ADDR",
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
DEFAULT_PORT = 5555
"""The lab's namespaces are new and empty, so a fixed port is always free there
(`splitrl.cli.free_port_pair` checks the host's loopback, which is not where the
stages listen)."""
BULK_PORT = 5557
STOP_GRACE_S = 15.0
"""How long stopped stages get to abort and exit before they are killed."""
COMMAND_TIMEOUT_S = 15.0
_MIB = 1024 * 1024


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


SIDES = ("stage0", "stage1")
ADDRESSES = {"stage0": STAGE0_ADDR, "stage1": STAGE1_ADDR}


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


def format_lab_plan(names: LabNames, shaping: Shaping, stage_cmds: dict[str, list[str]] | None = None) -> str:
    """The dry-run text: every command the lab would run, in order. Pure."""
    lines = ["# namespaces and the veth pair"] + [shlex.join(c) for c in setup_commands(names)]
    for side in ("stage1", "stage0"):
        lines.append(f"# shaping of {side}'s egress")
        lines.append(format_plan(plan_shaping(names.dev(side), shaping, names.ns(side))))
    for side, cmd in (stage_cmds or {}).items():
        lines.append(f"# {side}")
        lines.append(shlex.join(["ip", "netns", "exec", names.ns(side)] + cmd))
    lines.append("# on exit (normal end, failure or Ctrl-C)")
    lines += [shlex.join(c) for c in teardown_commands(names)]
    return "\n".join(lines)


def lab_namespaces(run: Runner | None = None) -> list[str]:
    """Namespaces whose names say a splitrl lab made them (``ip netns list``)."""
    out = (run or run_command)(["ip", "netns", "list"])
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(rf"{NS_PREFIX}s[01]-[0-9a-f]+", n)]


# -- the lab ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """One interface's kernel counters (``rtnl_link_stats64``, the same as /sys/class/net/DEV/statistics)."""

    tx_bytes: int = 0
    tx_packets: int = 0
    rx_bytes: int = 0
    rx_packets: int = 0

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))


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
            self.applied.append(apply_shaping(plan, allow_partial=self.allow_partial, run=self.run))
        log.info("lab %s up: %s", self.names.tag, "; ".join(a.summary() for a in self.applied))

    def spawn(self, side: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``side``'s namespace; `down` stops it."""
        cmd = ["ip", "netns", "exec", self.ns(side), *argv]
        popen_kwargs.setdefault("env", _child_env())
        proc = subprocess.Popen(cmd, **popen_kwargs)
        self.procs.append(proc)
        return proc

    def exec_text(self, side: str, argv: Sequence[str]) -> str:
        return self.run(["ip", "netns", "exec", self.ns(side), *argv])

    def counters(self, side: str) -> Counters:
        out = self.run(["ip", "-n", self.ns(side), "-s", "-j", "link", "show", "dev", self.dev(side)])
        stats = json.loads(out)[0]["stats64"]
        return Counters(stats["tx"]["bytes"], stats["tx"]["packets"], stats["rx"]["bytes"], stats["rx"]["packets"])

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
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.05)
        for p in alive:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)

    def down(self, grace: float = STOP_GRACE_S) -> None:
        """Stop processes, delete both namespaces. Never raises for what is already gone."""
        if not self._up:
            return
        with _signals_deferred():
            self.stop_processes(grace)
            problems = []
            for ns in self.names.namespaces:
                # Anything else still running in the namespace keeps it (and its veth end)
                # alive after `ip netns delete`; everything in it is ours.
                with contextlib.suppress(ShapingError):
                    for pid in self.run(["ip", "netns", "pids", ns]).split():
                        with contextlib.suppress(ProcessLookupError, ValueError):
                            os.kill(int(pid), signal.SIGKILL)
                try:
                    self.run(["ip", "netns", "delete", ns])
                except ShapingError as exc:
                    if "No such file" not in str(exc):
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


# -- throughput ------------------------------------------------------------------------

_BULK_KIND = "bulk"
_ACK_KIND = "ack"


@dataclass(frozen=True)
class Throughput:
    """One bulk transfer stage0 -> stage1 through `ZmqTransport`."""

    app_bytes: int
    """What the sender's meter counted for the timed messages (frame payloads)."""
    messages: int
    seconds: float
    wire_bytes: int
    """The sender's veth tx_bytes over the same interval (headers included)."""
    wire_packets: int

    @property
    def goodput_bits(self) -> float:
        return self.app_bytes * 8 / self.seconds

    @property
    def wire_bits(self) -> float:
        return self.wire_bytes * 8 / self.seconds

    def text(self) -> str:
        return (
            f"{format_rate(self.goodput_bits)} of application bytes ({format_size(self.app_bytes)} in "
            f"{self.messages} messages, {self.seconds:.2f} s), {format_rate(self.wire_bits)} on the wire "
            f"({self.wire_packets} packets, kernel tx counter)"
        )


def _sysfs_counters(dev: str) -> tuple[int, int]:
    base = Path("/sys/class/net") / dev / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "tx_packets").read_text())


def bulk_peer_main(argv: Sequence[str] | None = None) -> None:
    """One end of `measure_throughput`, run inside a namespace: ``ROLE ENDPOINT COUNT SIZE DEV TIMEOUT``."""
    role, endpoint, count_s, size_s, dev, timeout_s = list(argv if argv is not None else sys.argv[1:])
    count, size, timeout = int(count_s), int(size_s), float(timeout_s)
    import torch

    from ..transport import ZmqTransport

    torch.set_num_threads(1)
    start_timeout = 120.0  # the peer imports torch first; on a busy machine that takes a while
    if role == "recv":
        with ZmqTransport(endpoint, bind=True, timeout=timeout, name="bulk sender") as link:
            link.recv(timeout=start_timeout)
            link.send(_ACK_KIND)
            for _ in range(count):
                link.recv()
            link.send(_ACK_KIND)
        return  # closing lingers until the ack is out
    data = torch.zeros(size, dtype=torch.uint8)  # never modified, so it may be sent zero-copy again and again
    with ZmqTransport(endpoint, bind=False, timeout=timeout, name="bulk receiver") as link:
        link.send(_BULK_KIND, {"data": data}, timeout=start_timeout)  # warm-up: connections up, receiver ready
        link.recv(timeout=start_timeout)
        sent0 = link.meter.total("sent")
        tx0, packets0 = _sysfs_counters(dev)
        t0 = time.perf_counter()
        for _ in range(count):
            link.send(_BULK_KIND, {"data": data})
        link.recv()
        seconds = time.perf_counter() - t0
        tx1, packets1 = _sysfs_counters(dev)
        print(json.dumps({
            "app_bytes": link.meter.total("sent") - sent0, "messages": count, "seconds": seconds,
            "wire_bytes": tx1 - tx0, "wire_packets": packets1 - packets0,
        }), flush=True)


_BULK_PEER = "from splitrl.netem.lab import bulk_peer_main; bulk_peer_main()"


def measure_throughput(
    lab: Lab, total_bytes: int = 8 * _MIB, message_bytes: int = _MIB, port: int = BULK_PORT
) -> Throughput:
    """Send ``total_bytes`` in ``message_bytes`` messages from the stage0 namespace to the stage1 one."""
    count = max(1, total_bytes // message_bytes)
    rate = lab.shaping.rate or 10**9
    timeout = 30.0 + 3 * message_bytes * 8 / rate  # per message
    deadline = 150.0 + 3 * count * message_bytes * 8 / rate
    endpoint = f"tcp://{STAGE1_ADDR}:{port}"
    args = [str(count), str(message_bytes)]
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}

    def peer(side: str, role: str) -> subprocess.Popen:
        argv = [sys.executable, "-c", _BULK_PEER, role, endpoint, *args, lab.dev(side), str(timeout)]
        return lab.spawn(side, argv, **pipe)

    receiver = peer("stage1", "recv")
    sender = peer("stage0", "send")
    try:
        out, err = sender.communicate(timeout=deadline)
        if sender.returncode != 0 or not out.strip():
            lab.stop_processes(grace=2)
            _, receiver_err = receiver.communicate(timeout=10)
            raise RuntimeError(
                f"the throughput measurement failed (sender exit {sender.returncode}):\n{err.strip()[-2000:]}"
                + (f"\nreceiver: {receiver_err.strip()[-1000:]}" if receiver_err.strip() else "")
            )
        receiver.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        lab.stop_processes(grace=2)
        raise RuntimeError(f"the throughput measurement did not finish within {deadline:.0f} s") from None
    return Throughput(**json.loads(out.strip().splitlines()[-1]))


# -- byte accounting -------------------------------------------------------------------


@dataclass(frozen=True)
class SideBytes:
    """What one side's application sent beside its veth end's kernel counters."""

    side: str
    dev: str
    app_sent: int
    app_messages: int
    tx_bytes: int
    tx_packets: int
    header_bytes: int
    """Per packet (see `Lab.header_bytes`)."""
    tcp: dict[str, int] = field(default_factory=dict)
    """Deltas of the namespace's TCP counters over the run (OutSegs, RetransSegs, AttemptFails, ...)."""

    @property
    def headers(self) -> int:
        return self.tx_packets * self.header_bytes

    @property
    def corrected(self) -> int:
        """Kernel bytes minus the headers: the TCP payload, i.e. the ZeroMQ byte stream."""
        return self.tx_bytes - self.headers

    @property
    def raw_ratio(self) -> float:
        return self.tx_bytes / self.app_sent if self.app_sent else float("nan")

    @property
    def corrected_ratio(self) -> float:
        return self.corrected / self.app_sent if self.app_sent else float("nan")

    @property
    def residual(self) -> int:
        return self.corrected - self.app_sent


def _close_bytes(seq: int) -> int:
    """Bytes of stage0's final ``close`` message (sent after its last metrics line), by the reference encoder."""
    from ..transport.wire import encode, frame_nbytes

    return sum(frame_nbytes(f) for f in encode("close", seq))


def app_bytes_from_metrics(run_dir: str | Path) -> dict[str, tuple[int, int]]:
    """(bytes, messages) each side sent, from stage0's last metrics line.

    stage0: its meter's ``net_total/*/sent_*`` (the handshake included) plus the
    ``close`` message that follows the last line. stage1 writes no meter of its
    own; by the protocol (docs/PROTOCOL.md section 9: the same number on both
    sides) what it sent is what stage0's meter received, ``net_total/*/recv_*``.
    """
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    if not lines:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    last = json.loads(lines[-1])

    def total(direction: str, what: str) -> int:
        return sum(int(v) for k, v in last.items() if k.startswith("net_total/") and k.endswith(f"/{direction}_{what}"))

    sent_messages = total("sent", "messages")
    return {
        "stage0": (total("sent", "bytes") + _close_bytes(sent_messages), sent_messages + 1),
        "stage1": (total("recv", "bytes"), total("recv", "messages")),
    }


# -- the whole run ---------------------------------------------------------------------


@dataclass
class LabResult:
    names: LabNames
    applied: list[Applied]
    throughput: Throughput | None
    codes: dict[str, int | None]
    run_dir: str
    sides: list[SideBytes] = field(default_factory=list)
    interrupted: bool = False

    @property
    def code(self) -> int:
        if self.interrupted:
            return 130
        return next((c for c in self.codes.values() if c), 0) if all(c is not None for c in self.codes.values()) else 1


def stage_commands(stage_args: Sequence[str], port: int = DEFAULT_PORT) -> dict[str, list[str]]:
    base = [sys.executable, "-m", "splitrl"]
    endpoint = f"tcp://{STAGE1_ADDR}:{port}"
    return {
        "stage1": base + ["stage1", "--bind", endpoint, *stage_args],
        "stage0": base + ["stage0", "--connect", endpoint, *stage_args],
    }


def _wait(procs: dict[str, subprocess.Popen], grace: float) -> None:
    """Until both exit; once one has failed, the other gets ``grace`` seconds (it should follow via abort)."""
    deadline = None
    while True:
        codes = [p.poll() for p in procs.values()]
        if all(c is not None for c in codes):
            return
        if deadline is None and any(c not in (None, 0) for c in codes):
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() > deadline:
            return
        time.sleep(0.1)


def run_lab(
    stage_args: Sequence[str],
    run_dir: str,
    shaping: Shaping,
    *,
    allow_partial: bool = False,
    measure_bytes: int = 8 * _MIB,
    port: int = DEFAULT_PORT,
    grace: float = STOP_GRACE_S,
    names: LabNames | None = None,
    echo: Any = print,
) -> LabResult:
    """Bring the lab up, measure throughput, train (``stage_args`` to both stages), account, tear down.

    ``stage_args`` must include ``--run-dir run_dir``. Ctrl-C / SIGTERM (as
    KeyboardInterrupt) stops both stages with SIGTERM (they tell each other and
    exit), then the lab is removed; the result then has ``interrupted`` set.
    """
    names = names or LabNames.random()
    result = LabResult(names, [], None, {"stage1": None, "stage0": None}, run_dir)
    with Lab(shaping, allow_partial=allow_partial, names=names) as lab:
        result.applied = lab.applied
        echo(f"lab {names.tag}: {names.ns('stage1')} ({STAGE1_ADDR}) <-> {names.ns('stage0')} ({STAGE0_ADDR})")
        for applied in lab.applied:
            echo(f"  shaped {applied.summary()}")
            for note in applied.notes:
                echo(f"  note: {note}")
        procs: dict[str, subprocess.Popen] = {}
        try:
            if measure_bytes > 0:
                echo(f"measuring throughput stage0 -> stage1 with {format_size(measure_bytes)} ...")
                result.throughput = measure_throughput(lab, measure_bytes)
                echo(f"  {format_rate(result.throughput.goodput_bits)} (details at the end)")
            before = {s: lab.counters(s) for s in SIDES}
            tcp_before = {s: lab.tcp_stats(s) for s in SIDES}
            cmds = stage_commands(stage_args, port)
            for side in ("stage1", "stage0"):
                procs[side] = lab.spawn(side, cmds[side])
            _wait(procs, grace)
        except KeyboardInterrupt:
            echo("interrupted: stopping both stages and removing the lab")
            result.interrupted = True
            lab.stop_processes(grace)
            return result
        finally:
            result.codes.update({side: p.poll() for side, p in procs.items()})
        if any(c != 0 for c in result.codes.values()):
            echo(f"a stage failed (stage1 exit {result.codes['stage1']}, stage0 exit {result.codes['stage0']}); "
                 "no byte accounting")
            return result
        time.sleep(0.3)  # the last FIN/ACKs through the shaper
        header = lab.header_bytes()
        app = app_bytes_from_metrics(run_dir)
        for side in SIDES:
            delta = lab.counters(side) - before[side]
            tcp_after = lab.tcp_stats(side)
            keys = ("OutSegs", "RetransSegs", "AttemptFails", "OutRsts")
            tcp = {k: tcp_after[k] - tcp_before[side].get(k, 0) for k in keys if k in tcp_after}
            sent, messages = app[side]
            result.sides.append(
                SideBytes(side, lab.dev(side), sent, messages, delta.tx_bytes, delta.tx_packets, header, tcp)
            )
    return result


def format_report(result: LabResult) -> str:
    """The byte accounting table and what the differences are made of."""
    lines = []
    rate = next((a.shaping for a in result.applied), "?")
    if result.throughput:
        lines.append(f"achieved throughput stage0 -> stage1 (link shaped to {rate}): {result.throughput.text()}")
    if not result.sides:
        return "\n".join(lines)
    h = result.sides[0].header_bytes
    lines += [
        "",
        f"bytes sent during the training run (run dir {result.run_dir}):",
        "",
        f"| side | veth | app bytes sent | kernel tx bytes | tx packets | headers ({h} B/packet) | kernel - headers "
        "| kernel / app | (kernel - headers) / app |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result.sides:
        lines.append(
            f"| {s.side} | {s.dev} | {s.app_sent:,} | {s.tx_bytes:,} | {s.tx_packets:,} | {s.headers:,} | "
            f"{s.corrected:,} | {s.raw_ratio:.4f} | {s.corrected_ratio:.4f} |"
        )
    lines += [
        "",
        "- app bytes: stage0's meter (metrics.jsonl net_total/*/sent_bytes, plus its final 'close' message); stage1 "
        "writes no meter, so its bytes are what stage0's meter received (net_total/*/recv_bytes), the same number "
        "by the protocol.",
        "- kernel: tx_bytes/tx_packets of each side's veth end over the run (GSO off on the veth: one packet is one "
        "TCP segment, an ACK, or an ARP frame).",
        f"- headers: Ethernet 14 + IPv4 20 + TCP 20{' + timestamps 12' if h == 66 else ''} = {h} B on every "
        "packet; an ACK is nothing else, so the ACKs for the other side's data vanish with the correction.",
    ]
    for s in result.sides:
        per = s.residual / s.app_messages if s.app_messages else 0.0
        tcp = ", ".join(f"{k} {v}" for k, v in s.tcp.items())
        retrans = s.tcp.get("RetransSegs", 0)
        lines.append(
            f"- {s.side}: kernel - headers - app = {s.residual:+,} B ({per:+.1f} B per message, {s.app_messages} "
            f"messages), made of ZeroMQ's framing (64 B greeting + READY per connection, 2 B per frame <= 255 B, "
            f"9 B above), SYN options (+8 B each), ARP (-24 B each) and {retrans} retransmitted segment(s) "
            f"(up to {retrans * MSS_BYTES:,} B; tail-loss probes count too); TCP counters over the run: {tcp or 'n/a'}"
        )
    return "\n".join(lines)
