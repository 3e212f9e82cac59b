"""The two-host lab on one machine (``splitrl lab``): both stages in a `splitrl.netem.netns.Lab`, and what crossed.

The lab (two network namespaces joined by a veth pair shaped alike in both
directions, `splitrl.netem.netns`) runs the real ``splitrl stage1`` /
``splitrl stage0`` processes inside, with any training settings. This module
measures the link, runs the stages to the end and accounts for the bytes.

Byte accounting. Each veth end counts what the kernel sent; the stages' meters
count frame payloads (docs/PROTOCOL.md section 9). The kernel's bytes include
66 bytes of headers per packet (see `splitrl.netem.netns`: GSO is off on the
veth, so a packet is one TCP segment), so the report gives both the raw ratio
and the ratio after subtracting ``tx_packets x 66``. What remains after the
correction is named in the report: ZeroMQ's own framing (a 64-byte greeting and
a READY command per connection, 2 bytes per frame up to 255 bytes, 9 above),
SYN options (+8 bytes each), ARP (-24 each) and retransmitted segments.

Throughput. Before training, `measure_throughput` sends 1 MiB messages through
the project's own `ZmqTransport` from the stage0 namespace to the stage1 one
(`splitrl.bench.throughput_probe` at both ends) and times them until the
receiver acknowledges the last: application bytes per second (goodput), beside
the wire rate from the same kernel counters. At 20 Mbit/s goodput is at most
20 x 1448 / 1514 = 19.1 Mbit/s: tc's rate counts the Ethernet and IP/TCP headers too.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..launch import STOP_GRACE_S, supervise
from ..netem.netns import SIDES, STAGE0_ADDR, STAGE1_ADDR, Lab, LabNames
from ..netem.tc import MSS_BYTES, Applied, Shaping, format_rate, format_size
from ..plan import TCP_GOODPUT
from ..runs import link_bytes, link_messages, read_metrics
from ..settings import RunOptions
from ..transport.zmq_transport import HEARTBEAT_TIMEOUT_SHARE

__all__ = [
    "DEFAULT_PORT",
    "Throughput",
    "SideBytes",
    "LabResult",
    "measure_throughput",
    "app_bytes_from_metrics",
    "stage_commands",
    "spawn_stages",
    "run_lab",
    "format_report",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 5555
"""The lab's namespaces are new and empty, so a fixed port is always free there
(`splitrl.launch.free_port_pair` checks the host's loopback, which is not where the
stages listen)."""
BULK_PORT = 5557
PING_PORT = 5559
"""The round-trip probe's port pair, through the delay relay when there is one (as the stages' link is)."""
_MIB = 1024 * 1024


# -- throughput ------------------------------------------------------------------------


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


def _probe(lab: Lab, roles: tuple[str, str], port: int, count: int, size: int, timeout: float,
           deadline: float, what: str, connect_host: str = STAGE1_ADDR) -> dict[str, Any]:
    """Run the probe's two ends (stage1's namespace binds ``port``, then stage0's connects to it at
    ``connect_host``); the stage0 end's JSON line."""
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}

    def peer(side: str, role: str, host: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "splitrl.bench.throughput_probe", role, f"tcp://{host}:{port}", str(count),
                str(size), lab.dev(side), str(timeout)]
        return lab.spawn(side, argv, **pipe)

    receiver = peer("stage1", roles[1], STAGE1_ADDR)
    sender = peer("stage0", roles[0], connect_host)
    try:
        out, err = sender.communicate(timeout=deadline)
        if sender.returncode != 0 or not out.strip():
            lab.stop_processes(grace=2)
            _, receiver_err = receiver.communicate(timeout=10)
            raise RuntimeError(
                f"the {what} measurement failed (exit {sender.returncode}):\n{err.strip()[-2000:]}"
                + (f"\nother end: {receiver_err.strip()[-1000:]}" if receiver_err.strip() else "")
            )
        receiver.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        lab.stop_processes(grace=2)
        raise RuntimeError(f"the {what} measurement did not finish within {deadline:.0f} s") from None
    return json.loads(out.strip().splitlines()[-1])


def measure_throughput(
    lab: Lab, total_bytes: int = 8 * _MIB, message_bytes: int = _MIB, port: int = BULK_PORT
) -> Throughput:
    """Send ``total_bytes`` in ``message_bytes`` messages from the stage0 namespace to the stage1 one."""
    count = max(1, total_bytes // message_bytes)
    rate = lab.shaping.rate or 10**9
    timeout = 30.0 + 3 * message_bytes * 8 / rate  # per message
    deadline = 150.0 + 3 * count * message_bytes * 8 / rate
    result = _probe(lab, ("send", "recv"), port, count, message_bytes, timeout, deadline, "throughput")
    return Throughput(**result)


def measure_round_trip(lab: Lab, host: str, port: int, count: int = 20, size: int = 16384) -> list[float]:
    """Seconds of ``count`` round trips of a ``size``-byte message (one rollout step's features) from
    stage0's namespace to ``host`` (stage1, or the delay relay in front of it)."""
    rate = lab.shaping.rate or 10**9
    timeout = 30.0 + 3 * size * 8 / rate + 2 * lab.shaping.delay
    return _probe(lab, ("ping", "echo"), port, count, size, timeout, 150.0 + count * timeout, "round trip",
                  host)["rtt_s"]


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
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    last = records[-1]
    sent_messages = link_messages(last, "sent", everything=True)
    return {
        "stage0": (link_bytes(last, "sent", everything=True) + _close_bytes(sent_messages), sent_messages + 1),
        "stage1": (link_bytes(last, "recv", everything=True), link_messages(last, "recv", everything=True)),
    }


# -- the stages in the lab -------------------------------------------------------------


def _option(args: Sequence[str], name: str) -> str | None:
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


@dataclass
class LabResult:
    names: LabNames
    applied: list[Applied]
    throughput: Throughput | None
    codes: dict[str, int | None]
    run_dir: str
    sides: list[SideBytes] = field(default_factory=list)
    interrupted: bool = False
    shaping: Shaping = field(default_factory=Shaping)
    round_trip: list[float] = field(default_factory=list)
    """Seconds of each probe round trip (16 KiB out, 16 KiB back) stage0's way to stage1."""

    def round_trip_text(self, shaping: Shaping) -> str:
        if not self.round_trip:
            return ""
        rtt = sorted(self.round_trip)
        median = rtt[len(rtt) // 2]
        set_ms = f"{2e3 * shaping.delay:g} ms set ({1e3 * shaping.delay:g} ms each way)" if shaping.delay else "no delay set"
        return (f"round trip stage0 -> stage1 -> stage0, 16 KiB each way, measured: median {1e3 * median:.2f} ms "
                f"(min {1e3 * rtt[0]:.2f}, max {1e3 * rtt[-1]:.2f}, {len(rtt)} round trips); {set_ms}")

    @property
    def code(self) -> int:
        if self.interrupted:
            return 130
        return next((c for c in self.codes.values() if c), 0) if all(c is not None for c in self.codes.values()) else 1


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
    echo: Callable[[str], Any] | None = None,
) -> LabResult:
    """Bring the lab up, measure throughput, train (``stage_args`` to both stages), account, tear down.

    ``stage_args`` must include ``--run-dir run_dir``. Ctrl-C / SIGTERM (as
    KeyboardInterrupt) stops both stages with SIGTERM (they tell each other and
    exit), then the lab is removed; the result then has ``interrupted`` set.
    """
    echo = echo or log.info
    names = names or LabNames.random()
    result = LabResult(names, [], None, {"stage1": None, "stage0": None}, run_dir, shaping=shaping)

    def interrupted() -> None:
        echo("interrupted: stopping both stages and removing the lab")
        result.interrupted = True

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
            if lab.relay_delay is not None and _option(stage_args, "--transport") == "torch-rpc":
                raise ValueError("the delay relay carries ZeroMQ and plain TCP links; torch RPC opens ports of its "
                                 "own that would bypass it: use --transport zmq or tcp, or a kernel with netem")
            host = lab.start_relay([port, port + 1, PING_PORT, PING_PORT + 1])
            result.round_trip = measure_round_trip(lab, host, PING_PORT)
            echo(f"  {result.round_trip_text(shaping)}")
            before = {s: lab.counters(s) for s in SIDES}
            tcp_before = {s: lab.tcp_stats(s) for s in SIDES}
            procs = spawn_stages(lab, stage_args, port, connect_host=host)
            supervise(list(procs.values()), grace=grace, on_interrupt=interrupted)
        except KeyboardInterrupt:
            if not result.interrupted:  # during the throughput measurement: leaving the lab stops its peers
                interrupted()
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
    if result.round_trip:
        lines.append(result.round_trip_text(result.shaping))
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
