"""``splitrl lab``: bring a lab up, measure its link, run both stages to the end, account for the bytes.

`run_lab` does it all and removes the lab on every exit path (normal end, failure or
Ctrl-C); `format_report` is the throughput, the round trip and the byte accounting
table of its `LabResult`.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..launch import STOP_GRACE_S, supervise
from ..netem.netns import SIDES, STAGE0_ADDR, STAGE1_ADDR, Lab, LabNames
from ..netem.tc import MSS_BYTES, Applied, Shaping, format_rate, format_size
from .accounting import SideBytes, app_bytes_from_metrics
from .link import PING_PORT, Throughput, measure_round_trip, measure_throughput
from .stages import DEFAULT_PORT, option_value, spawn_stages

__all__ = ["LabResult", "run_lab", "format_report"]

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


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
            if lab.relay_delay is not None and option_value(stage_args, "--transport") == "torch-rpc":
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
