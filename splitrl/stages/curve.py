"""The learning curve of a run directory as a markdown table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..runs import link_bytes, read_metrics

__all__ = ["curve_table"]


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def curve_table(run_dir: str | Path) -> str:
    """Per iteration: steps, EMA(0.9) return, mean return of its episodes, steps/s, MB on the link."""
    rows = read_metrics(run_dir)
    lines = [
        "| iteration | global_step | EMA(0.9) return | mean return | episodes | steps/s | MB on the link (cumulative) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = link_bytes(r)
        lines.append(
            f"| {r['iteration']} | {r['global_step']} | {_fmt(r.get('charts/episodic_return_ema'), '.1f')} "
            f"| {_fmt(r.get('charts/episodic_return'), '.1f')} | {r.get('charts/episodes', 0)} "
            f"| {r['charts/SPS']:.1f} | {total / 1e6:.0f} |"
        )
    return "\n".join(lines)
