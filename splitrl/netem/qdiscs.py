"""tc's JSON (``tc -j qdisc show dev DEV``) in words: what shapes an interface now. Pure."""

from __future__ import annotations

from typing import Any

from ..units import format_rate, format_size, format_time

__all__ = ["describe_qdiscs", "root_qdisc", "is_default", "DEFAULT_QDISCS", "SPLITRL_QDISCS"]

DEFAULT_QDISCS = frozenset({"noqueue", "pfifo_fast", "fq_codel", "fq", "mq", "noop", "pfifo", "cake", "sfq"})
"""Qdisc kinds the kernel attaches by itself (handle ``0:``): no shaping."""
SPLITRL_QDISCS = ("netem", "tbf")
"""What `splitrl.netem.tc.apply_shaping` installs, and so what its `clear_shaping` removes."""


def root_qdisc(qdiscs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The root qdisc among tc's list (the first one when none says it is root); None for an empty list."""
    return next((q for q in qdiscs if q.get("root")), qdiscs[0] if qdiscs else None)


def is_default(q: dict[str, Any]) -> bool:
    """Whether the kernel attached ``q`` by itself: nothing shapes through it."""
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
    root = root_qdisc(qdiscs)
    if root is None:
        return f"{dev}: no qdisc reported"
    if is_default(root):
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

