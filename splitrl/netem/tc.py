"""Shape a network interface with Linux tc: build the commands, run them, say what is in place.

splitrl exists to measure what a slow link costs a split training run. Two
machines on a real 20 Mbit/s link are rarely at hand, so this module shapes an
interface of one machine instead (``splitrl netem``), and `splitrl.netem.netns`
uses it on both ends of a veth pair between two network namespaces.

Two qdiscs can do it:

- **netem** does everything asked for in one qdisc: rate, delay, jitter and
  random loss, with a queue limit in packets. It is the first choice.
- **tbf** (token bucket filter) does rate only. Many minimal kernels build tbf
  but not sch_netem (``tc`` then says "Specified qdisc kind is unknown"); this
  module falls back to tbf there.

The fallback policy: a request for rate only loses nothing with tbf, so it falls
back with a note. A request with delay, jitter or loss cannot be honoured without
netem (the kernel has no other qdisc that delays or drops on purpose), and an
experiment that silently ran without its 20 ms of delay would be reported as if
it had them. So that is an error naming what cannot be applied, unless the user
passes ``allow_partial`` (``--allow-partial``), which applies the rate with tbf
and warns. Nothing on the interface changes before that decision: the netem
command fails atomically when the qdisc is missing.

The pure functions (`plan_shaping`, `clear_command`, `show_command`,
`describe_qdiscs`) build argv lists and read tc's JSON; `run_command` executes
one argv without a shell and turns tc's and ip's failures into one clear
`ShapingError`. Every function that runs something takes the runner as an
argument, so tests replace it.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..units import format_rate, format_size, format_time, parse_loss, parse_rate, parse_time

__all__ = [
    "Shaping",
    "Plan",
    "Applied",
    "ShapingError",
    "ToolMissing",
    "NotPermitted",
    "NoSuchDevice",
    "NetemMissing",
    "PartialShaping",
    "Runner",
    "parse_rate",
    "parse_time",
    "parse_loss",
    "format_rate",
    "format_size",
    "format_time",
    "tbf_sizes",
    "netem_limit",
    "plan_shaping",
    "format_plan",
    "apply_shaping",
    "clear_command",
    "clear_shaping",
    "show_command",
    "show_shaping",
    "describe_qdiscs",
    "run_command",
    "MESSAGE_BYTES",
    "FRAME_BYTES",
    "MSS_BYTES",
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
DEFAULT_QDISCS = frozenset({"noqueue", "pfifo_fast", "fq_codel", "fq", "mq", "noop", "pfifo", "cake", "sfq"})
"""Qdisc kinds the kernel attaches by itself (handle ``0:``): no shaping."""
SPLITRL_QDISCS = ("netem", "tbf")
"""What `apply_shaping` installs, and so what `clear_shaping` removes."""

Runner = Callable[[Sequence[str]], str]
"""Runs one argv and returns its stdout, or raises `ShapingError`."""


# -- errors ----------------------------------------------------------------------------


class ShapingError(RuntimeError):
    """Shaping failed; the message says why in terms the user can act on."""


class ToolMissing(ShapingError):
    """``tc`` or ``ip`` is not installed."""


class NotPermitted(ShapingError):
    """Not root and no CAP_NET_ADMIN."""


class NoSuchDevice(ShapingError):
    """The interface does not exist (in the namespace asked for)."""


class NetemMissing(ShapingError):
    """The kernel has no netem qdisc (sch_netem not built or not loaded)."""


class PartialShaping(ShapingError):
    """Without netem, some requested options cannot be applied and partial shaping was not allowed."""


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


@dataclass(frozen=True)
class Applied:
    """What `apply_shaping` did."""

    dev: str
    qdisc: str
    """``netem`` or ``tbf``."""
    shaping: str
    """What is now in place, in words."""
    commands: list[list[str]]
    not_applied: tuple[str, ...] = ()
    """Requested options that are not in place (tbf fallback with ``allow_partial``)."""
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        text = f"{self.dev}: {self.shaping} via {self.qdisc}"
        if self.not_applied:
            text += f"; NOT applied (the kernel has no netem qdisc): {', '.join(self.not_applied)}"
        return text


def apply_shaping(plan: Plan, *, allow_partial: bool = False, run: Runner | None = None) -> Applied:
    """Shape with netem; where the kernel has none, with tbf under the policy in the module docstring.

    Raises `NetemMissing` when netem is missing and tbf cannot help (no rate),
    `PartialShaping` when delay/jitter/loss would be lost and ``allow_partial``
    is false (the interface is left as it was in both cases), and the runner's
    errors (`ToolMissing`, `NotPermitted`, `NoSuchDevice`, ...) as they come.
    """
    run = run or run_command
    try:
        for cmd in plan.netem:
            run(cmd)
        return Applied(plan.dev, "netem", plan.shaping.describe(), plan.netem, notes=plan.notes)
    except NetemMissing:
        pass
    where = f" in namespace {plan.netns}" if plan.netns else ""
    if not plan.tbf:
        raise NetemMissing(
            f"cannot apply {', '.join(plan.tbf_cannot)} on {plan.dev}{where}: the kernel has no netem qdisc "
            "(sch_netem; try `modprobe sch_netem`), and without --rate there is nothing tbf could shape"
        )
    if plan.tbf_cannot and not allow_partial:
        raise PartialShaping(
            f"the kernel has no netem qdisc, so {', '.join(plan.tbf_cannot)} cannot be applied on {plan.dev}{where}; "
            f"nothing was changed. Load sch_netem (`modprobe sch_netem`), or pass --allow-partial to apply "
            f"the rate alone with tbf"
        )
    for cmd in plan.tbf:
        run(cmd)
    rate_text = f"rate {format_rate(plan.shaping.rate or 0)}"
    notes = ("the kernel has no netem qdisc, so tbf shapes the rate",)
    return Applied(plan.dev, "tbf", rate_text, plan.tbf, not_applied=plan.tbf_cannot, notes=notes)


# -- clear and show --------------------------------------------------------------------


def show_command(dev: str, netns: str | None = None) -> list[str]:
    return _tc(netns) + ["-j", "qdisc", "show", "dev", dev]


def clear_command(dev: str, netns: str | None = None) -> list[str]:
    return _tc(netns) + ["qdisc", "del", "dev", dev, "root"]


def _root(qdiscs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((q for q in qdiscs if q.get("root")), qdiscs[0] if qdiscs else None)


def _is_default(q: dict[str, Any]) -> bool:
    return q.get("handle") in ("0:", "0") or q.get("kind") == "noqueue"


def _describe_one(q: dict[str, Any]) -> str:
    kind = q.get("kind", "?")
    opts = q.get("options") or {}
    if kind == "tbf":
        rate = float(opts.get("rate", 0)) * 8  # tc's JSON gives rates in bytes per second
        burst = float(opts.get("burst", 0))
        text = f"rate {format_rate(rate)} via tbf, burst {format_size(burst)}"
        if "limit" in opts:
            text += f", queue limit {format_size(float(opts['limit']))}"
        elif "lat" in opts and rate:
            # tc reports tbf's limit as the time a full queue takes to drain ("lat", in us).
            lat = float(opts["lat"]) / 1e6
            text += f", queue limit {format_size(lat * rate / 8 + burst)} ({format_time(lat)} at the rate)"
        return text
    if kind == "netem":
        parts = []
        rate = (opts.get("rate") or {}).get("rate")
        if rate:
            parts.append(f"rate {format_rate(float(rate) * 8)}")
        delay = opts.get("delay") or {}
        if delay.get("delay"):
            text = f"delay {format_time(float(delay['delay']))}"
            if delay.get("jitter"):
                text += f" ± {format_time(float(delay['jitter']))}"
            parts.append(text)
        loss = (opts.get("loss-random") or {}).get("loss")
        if loss:
            parts.append(f"loss {float(loss) * 100:g} %")  # JSON: a fraction; text: percent
        for other in ("loss-state", "loss-gemodel", "duplicate", "reorder", "corrupt", "slot"):
            if opts.get(other):
                parts.append(other)
        if "limit" in opts:
            parts.append(f"queue limit {opts['limit']} packets")
        return "via netem: " + (", ".join(parts) if parts else "no impairment set")
    raw = ", ".join(f"{k} {v}" for k, v in opts.items()) if isinstance(opts, dict) else str(opts)
    return f"qdisc {kind}" + (f" ({raw})" if raw else "")


def describe_qdiscs(dev: str, qdiscs: list[dict[str, Any]]) -> str:
    """tc's JSON (``tc -j qdisc show dev DEV``) in words, one line. Pure."""
    root = _root(qdiscs)
    if root is None:
        return f"{dev}: no qdisc reported"
    if _is_default(root):
        kind = root.get("kind", "?")
        children = sorted({q.get("kind", "?") for q in qdiscs if q is not root})
        extra = f" with {'/'.join(children)} per queue" if children else ""
        return f"{dev}: no shaping (default qdisc {kind}{extra})"
    text = f"{dev}: {_describe_one(root)}"
    if root.get("kind") not in SPLITRL_QDISCS:
        text += " (not installed by splitrl netem)"
    children = [q for q in qdiscs if q is not root]
    if children:
        text += "; also: " + "; ".join(_describe_one(q) for q in children)
    return text


def _qdiscs(dev: str, netns: str | None, run: Runner) -> list[dict[str, Any]]:
    out = run(show_command(dev, netns))
    try:
        data = json.loads(out or "[]")
    except json.JSONDecodeError:
        raise ShapingError(f"could not read tc's JSON output for {dev} (tc too old for -j?):\n{out.strip()}") from None
    if not isinstance(data, list):
        raise ShapingError(f"unexpected tc JSON for {dev}: {out.strip()[:200]}")
    return data


def show_shaping(dev: str, netns: str | None = None, run: Runner | None = None) -> str:
    """What is in place on ``dev``, in words."""
    return describe_qdiscs(dev, _qdiscs(dev, netns, run or run_command))


def clear_shaping(dev: str, netns: str | None = None, run: Runner | None = None) -> str:
    """Remove the netem or tbf root qdisc from ``dev``; returns what was removed, in words.

    A root qdisc of any other kind was not put there by `apply_shaping`, so it is
    left alone with an error that says how to remove it by hand.
    """
    run = run or run_command
    qdiscs = _qdiscs(dev, netns, run)
    root = _root(qdiscs)
    if root is None or _is_default(root):
        return f"nothing to clear: {describe_qdiscs(dev, qdiscs)}"
    if root.get("kind") not in SPLITRL_QDISCS:
        raise ShapingError(
            f"the root qdisc on {dev} is {root.get('kind')}, which splitrl netem does not install; "
            f"not removing it (by hand: {shlex.join(clear_command(dev, netns))})"
        )
    before = describe_qdiscs(dev, qdiscs)
    run(clear_command(dev, netns))
    return f"removed: {before.split(': ', 1)[1]}; now: {show_shaping(dev, netns, run).split(': ', 1)[1]}"


# -- running ---------------------------------------------------------------------------

_DEVICE_RE = re.compile(r'Cannot find device "(?P<dev>[^"]*)"')


def classify_failure(argv: Sequence[str], stderr: str) -> ShapingError:
    """One clear error for a failed tc/ip command, from its stderr."""
    text = stderr.strip()
    cmd = shlex.join(argv)
    if "Specified qdisc kind is unknown" in text or re.search(r'Unknown qdisc "?netem', text):
        return NetemMissing(f"the kernel has no netem qdisc ({cmd}: {text})")
    if "Operation not permitted" in text or "Permission denied" in text:
        creates_ns = list(argv[:3]) == ["ip", "netns", "add"]
        caps = "CAP_SYS_ADMIN and CAP_NET_ADMIN" if creates_ns else "the CAP_NET_ADMIN capability"
        return NotPermitted(f"not permitted: {cmd} needs root or {caps} (run it with sudo) [{text}]")
    m = _DEVICE_RE.search(text)
    if m:
        dev = m["dev"]
        where = ""
        if "-n" in argv[:3]:
            where = f" in network namespace {argv[list(argv).index('-n') + 1]}"
        return NoSuchDevice(f"no network interface named {dev!r}{where} (list them with `ip link`)")
    if "Cannot open network namespace" in text:
        return ShapingError(f"{cmd}: {text} (see `ip netns list`)")
    return ShapingError(f"{cmd} failed: {text or 'no message'}")


def run_command(argv: Sequence[str], timeout: float = 15.0) -> str:
    """Run ``argv`` (no shell) and return its stdout; failures become `ShapingError`s."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise ToolMissing(
            f"{argv[0]!r} not found: it comes with iproute2 (Debian/Ubuntu: apt-get install iproute2)"
        ) from None
    except PermissionError as exc:
        raise NotPermitted(f"cannot run {argv[0]!r}: {exc}") from None
    except subprocess.TimeoutExpired:
        raise ShapingError(f"{shlex.join(argv)} did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        raise classify_failure(argv, proc.stderr or proc.stdout)
    return proc.stdout
