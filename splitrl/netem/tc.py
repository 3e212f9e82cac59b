"""Shape a network interface with Linux tc: run the commands, apply the fallback policy, say what is in place.

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

The pure parts live beside this module: `splitrl.netem.shaping` builds the argv
lists (`plan_shaping`, `clear_command`, `show_command`) and `splitrl.netem.qdiscs`
reads tc's JSON (`describe_qdiscs`); their names are re-exported here. This module
runs things: `run_command` executes one argv without a shell and turns tc's and
ip's failures into one clear `ShapingError`. Every function that runs something
takes the runner as an argument, so tests replace it.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..units import format_rate, format_size, format_time, parse_loss, parse_rate, parse_time
from .qdiscs import SPLITRL_QDISCS, describe_qdiscs, is_default, root_qdisc
from .shaping import (
    FRAME_BYTES,
    MESSAGE_BYTES,
    MSS_BYTES,
    Plan,
    Shaping,
    clear_command,
    format_plan,
    netem_limit,
    plan_shaping,
    show_command,
    tbf_sizes,
)

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
    root = root_qdisc(qdiscs)
    if root is None or is_default(root):
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
