"""The learning curve of a run directory as a markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_metrics", "curve_table"]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a splitrl run directory?)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break  # a run still writing its last line
            raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
    return records


def link_bytes(record: dict[str, Any]) -> int:
    """Bytes on the link up to this record, both directions: stage0's meters see what it sent and received."""
    return sum(v for k, v in record.items() if k.startswith("net_total/") and k.endswith("_bytes"))


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
