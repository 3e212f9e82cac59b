"""End-to-end benchmark: the same PPO iterations split over loopback and in one process.

Each mode runs as fresh processes (`splitrl run` for the split, `splitrl train` for
the twin), alternating, and the figures come from their metrics.jsonl, so the
benchmark measures exactly what a user runs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ..runs import read_metrics

__all__ = ["run_e2e_bench", "format_e2e_table", "PAPER_SECONDS_PER_ITERATION"]

PAPER_SECONDS_PER_ITERATION = (180.0, 250.0)
"""The paper's own code (torch RPC, one env) on a 2-core machine like ours, per 4096-step iteration."""

_PHASES = ("time/env", "time/encoder", "time/heads", "time/link_wait")


def _run_mode(mode: str, run_dir: Path, args: Sequence[str], timeout: float) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "splitrl", "run" if mode == "split" else "train", "--run-dir", str(run_dir), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return read_metrics(run_dir)


def run_e2e_bench(
    iterations: int = 1, repeats: int = 1, extra_args: Sequence[str] = (), timeout: float = 3600.0,
    out_dir: str | None = None,
) -> list[dict[str, Any]]:
    """One row per (mode, repeat): mean over its iterations of wall time, steps/s and phases."""
    base = Path(out_dir or tempfile.mkdtemp(prefix="splitrl-e2e-"))
    rows = []
    for repeat in range(repeats):
        modes = ("split", "twin") if repeat % 2 == 0 else ("twin", "split")
        for mode in modes:
            run_dir = base / f"{mode}-{repeat}"
            args = ["--total-steps", str(iterations * 4096), *extra_args]
            records = _run_mode(mode, run_dir, args, timeout)
            n = len(records)
            row: dict[str, Any] = {
                "mode": mode,
                "repeat": repeat,
                "iterations": n,
                "steps": records[-1]["global_step"],
                "seconds_per_iteration": sum(r["time/iteration"] for r in records) / n,
                "SPS": sum(r["charts/SPS"] for r in records) / n,
                "bytes_per_iteration": sum(
                    v for r in records for k, v in r.items() if k.startswith("net/") and k.endswith("_bytes")
                ) / n,
                "run_dir": str(run_dir),
            }
            for phase in _PHASES:
                row[phase] = sum(r[phase] for r in records) / n
            rows.append(row)
    return rows


def format_e2e_table(rows: list[dict[str, Any]]) -> str:
    twin = [r for r in rows if r["mode"] == "twin"]
    twin_sps = sum(r["SPS"] for r in twin) / len(twin) if twin else float("nan")
    lines = [
        "| mode | repeat | s/iteration | steps/s | vs twin | vs paper (180-250 s) | env s | encoder s | heads s | link wait s | MB/iteration |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lo, hi = PAPER_SECONDS_PER_ITERATION
    for r in rows:
        spi = r["seconds_per_iteration"]
        lines.append(
            f"| {r['mode']} | {r['repeat']} | {spi:.1f} | {r['SPS']:.1f} | {r['SPS'] / twin_sps:.2f}x "
            f"| {lo / spi:.1f}-{hi / spi:.1f}x faster | {r['time/env']:.1f} | {r['time/encoder']:.1f} "
            f"| {r['time/heads']:.1f} | {r['time/link_wait']:.1f} | {r['bytes_per_iteration'] / 1e6:.0f} |"
        )
    return "\n".join(lines)
