"""What to apply to one interface, and the tc commands that apply it: pure, nothing runs here.

`Shaping` is the link asked for (rate, delay, jitter, loss, queue limit); `plan_shaping`
turns it into a `Plan`: the netem command and the tbf fallback for a kernel without netem
(the fallback policy is `splitrl.netem.tc`'s). The queue sizes (`tbf_sizes`,
`netem_limit`) are chosen so one whole message fits.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from ..units import format_rate, format_time, parse_loss, parse_rate, parse_time

__all__ = [
    "Shaping",
    "Plan",
    "tbf_sizes",
    "netem_limit",
    "plan_shaping",
    "format_plan",
    "clear_command",
    "show_command",
    "MESSAGE_BYTES",
    "FRAME_BYTES",
    "MSS_BYTES",
    "TBF_MIN_BURST",
    "TICK_HZ",
    "NO_RATE_LINE_BITS",
]

MESSAGE_BYTES = 1024 * 1024
"""The largest message the queue must hold in one piece: training features and
gradients of a 128-sample minibatch are about 1 MiB. A queue smaller than one
message drops the tail of every such message and TCP spends its time recovering."""
FRAME_BYTES = 1514
"""A full-size Ethernet frame without FCS (1500 MTU + 14 header): what tc counts per packet."""
MSS_BYTES = 1448
"""TCP payload of a full-size frame with timestamps (1500 - 20 IP - 20 TCP - 12 options)."""
TBF_MIN_BURST = 32 * 1024
"""Smallest tbf bucket used: 13 ms at 20 Mbit/s, 21 full-size frames."""
TICK_HZ = 100
"""Timer rate assumed for tbf's burst rule (the tc-tbf manual's conservative case)."""
NO_RATE_LINE_BITS = 1_000_000_000
"""Without --rate, netem's queue must hold what the interface itself sends during
the delay; it is sized for a 1 Gbit/s interface."""


def _tc_rate(bits: int) -> str:
    """The exact rate in tc's syntax, in the largest unit that keeps it an integer."""
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def _tc_time(seconds: float) -> str:
    us = round(seconds * 1e6)
    if us % 1000 == 0:
        return f"{us // 1000}ms"
    return f"{us}us"


def _tc_percent(percent: float) -> str:
    return f"{percent:g}%"


# -- what to apply ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shaping:
    """What the link should look like, in one direction (egress of one interface).

    ``rate`` in bits per second, ``delay`` and ``jitter`` in seconds, ``loss`` in
    percent, ``limit`` in packets (netem's unit; None: sized for 1 MiB messages).
    """

    rate: int | None = None
    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    limit: int | None = None

    @classmethod
    def parse(
        cls,
        rate: str | None = None,
        delay: str | None = None,
        jitter: str | None = None,
        loss: str | None = None,
        limit: int | None = None,
    ) -> "Shaping":
        """From the command line's strings; raises ValueError naming the bad option."""
        return cls(
            rate=parse_rate(rate) if rate else None,
            delay=parse_time(delay, "delay") if delay else 0.0,
            jitter=parse_time(jitter, "jitter") if jitter else 0.0,
            loss=parse_loss(loss) if loss else 0.0,
            limit=limit,
        ).validate()

    def errors(self) -> list[str]:
        out = []
        if self.rate is not None and self.rate < 8:
            out.append(f"rate must be at least 8 bit/s, got {self.rate}")
        for name in ("delay", "jitter"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                out.append(f"{name} must be >= 0 seconds, got {value}")
        if self.jitter and not self.delay:
            out.append("jitter needs a delay to vary around (netem: delay TIME JITTER); give --delay too")
        if not 0.0 <= self.loss <= 100.0:
            out.append(f"loss must be between 0 and 100 %, got {self.loss}")
        if self.limit is not None and self.limit < 1:
            out.append(f"limit must be >= 1 packet, got {self.limit}")
        if self.empty:
            out.append("nothing to apply: give at least one of --rate, --delay, --loss")
        return out

    def validate(self) -> "Shaping":
        problems = self.errors()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def empty(self) -> bool:
        return self.rate is None and not self.delay and not self.loss and not self.jitter

    def netem_only(self) -> tuple[str, ...]:
        """The requested options only netem can apply, in words."""
        out = []
        if self.delay:
            out.append(f"delay {format_time(self.delay)}")
        if self.jitter:
            out.append(f"jitter {format_time(self.jitter)}")
        if self.loss:
            out.append(f"loss {self.loss:g} %")
        return tuple(out)

    def describe(self) -> str:
        parts = [f"rate {format_rate(self.rate)}"] if self.rate else []
        parts += list(self.netem_only())
        return ", ".join(parts) if parts else "nothing"


def tbf_sizes(rate_bits: int, limit_packets: int | None = None) -> tuple[int, int]:
    """tbf's ``burst`` and ``limit`` in bytes for a rate in bits per second.

    burst (the bucket): tbf drops a packet larger than its bucket, so it must
    hold a full frame; and it must hold what the rate delivers in one timer tick,
    or a late wake-up loses tokens and the shaper falls short of the rate:
    ``burst >= rate / HZ``, with HZ = 100 as the tc-tbf manual's worst case
    (hrtimers make it mostly moot; the cost of a bigger bucket is a short burst
    above the rate). So ``burst = max(32 KiB, rate_bytes / 100, 2 frames)``:
    32 KiB up to 26 Mbit/s, 1.25 MB at 1 Gbit/s.

    limit (the queue behind the bucket): one 1 MiB message must fit on top of a
    full bucket, ``limit >= 1 MiB + burst``; at 20 Mbit/s that is 1.06 MiB, about
    440 ms of queue. An explicit ``limit_packets`` wins, as full-size frames.
    """
    rate_bytes = rate_bits / 8
    burst = max(TBF_MIN_BURST, math.ceil(rate_bytes / TICK_HZ), 2 * FRAME_BYTES)
    limit = limit_packets * FRAME_BYTES if limit_packets else MESSAGE_BYTES + burst
    return burst, limit


def netem_limit(shaping: Shaping) -> int:
    """netem's queue limit in packets: one 1 MiB message plus what is in flight during the delay.

    netem holds every delayed packet in its queue, so besides one message
    (``ceil(1 MiB / 1448)`` = 725 full-size segments) it must hold the
    bandwidth-delay product ``rate * (delay + jitter)``, counted in full-size
    segments too (conservative: smaller packets only make fewer bytes). Without a
    rate the interface's own speed sets the product; it is taken as 1 Gbit/s.
    Never below tc's default of 1000. An explicit ``shaping.limit`` wins.
    """
    if shaping.limit:
        return shaping.limit
    line_bytes = (shaping.rate or NO_RATE_LINE_BITS) / 8
    in_flight = line_bytes * (shaping.delay + shaping.jitter)
    return max(1000, math.ceil((MESSAGE_BYTES + in_flight) / MSS_BYTES))


def _tc(netns: str | None) -> list[str]:
    return ["tc"] + (["-n", netns] if netns else [])


@dataclass(frozen=True)
class Plan:
    """The commands that shape ``dev``: with netem, and the tbf fallback for a kernel without it."""

    dev: str
    shaping: Shaping
    netns: str | None
    netem: list[list[str]]
    tbf: list[list[str]]
    """Empty when no rate was asked for (tbf has nothing else to offer)."""
    tbf_cannot: tuple[str, ...]
    """Requested options the tbf fallback does not apply, in words."""
    notes: tuple[str, ...] = field(default=())
    """Remarks about the netem plan (e.g. a queue smaller than one message)."""


def plan_shaping(dev: str, shaping: Shaping, netns: str | None = None) -> Plan:
    """Both ways to shape ``dev``'s egress (inside ``netns`` if given). Pure."""
    shaping.validate()
    if not dev or "/" in dev or dev.strip() != dev:
        raise ValueError(f"interface name {dev!r} is not valid")
    root = _tc(netns) + ["qdisc", "replace", "dev", dev, "root"]
    netem = ["netem"]
    if shaping.delay:
        netem += ["delay", _tc_time(shaping.delay)]
        if shaping.jitter:
            netem.append(_tc_time(shaping.jitter))
    if shaping.loss:
        netem += ["loss", "random", _tc_percent(shaping.loss)]
    if shaping.rate:
        netem += ["rate", _tc_rate(shaping.rate)]
    limit_packets = netem_limit(shaping)
    netem += ["limit", str(limit_packets)]
    notes = []
    if limit_packets * MSS_BYTES < MESSAGE_BYTES:
        notes.append(f"queue limit {limit_packets} packets holds less than one 1 MiB message: expect drops")
    if shaping.jitter and not shaping.rate:
        notes.append("netem reorders packets whose random delays cross; TCP takes reordering for loss")
    tbf: list[list[str]] = []
    if shaping.rate:
        burst, limit = tbf_sizes(shaping.rate, shaping.limit)
        tbf = [root + ["tbf", "rate", _tc_rate(shaping.rate), "burst", str(burst), "limit", str(limit)]]
    return Plan(dev, shaping, netns, [root + netem], tbf, shaping.netem_only(), tuple(notes))


def format_plan(plan: Plan) -> str:
    """The dry-run text: the netem commands, then the fallback a kernel without netem gets."""
    lines = ["# with the netem qdisc:"] + [shlex.join(c) for c in plan.netem]
    if plan.tbf:
        what = "rate only"
        if plan.tbf_cannot:
            what += f"; not applied: {', '.join(plan.tbf_cannot)} (needs --allow-partial)"
        lines.append(f"# where the kernel has no netem, tbf instead ({what}):")
        lines += [shlex.join(c) for c in plan.tbf]
    else:
        lines.append("# where the kernel has no netem: nothing can be applied (tbf only shapes a --rate)")
    lines += [f"# note: {n}" for n in plan.notes]
    return "\n".join(lines)


def show_command(dev: str, netns: str | None = None) -> list[str]:
    return _tc(netns) + ["-j", "qdisc", "show", "dev", dev]


def clear_command(dev: str, netns: str | None = None) -> list[str]:
    return _tc(netns) + ["qdisc", "del", "dev", dev, "root"]

