"""End-to-end benchmark: the same PPO iterations split over loopback and in one process.

Each mode runs as fresh processes (`splitrl run` for the split, `splitrl train` for
the twin), alternating, and the figures come from their metrics.jsonl, so the
benchmark measures exactly what a user runs. With ``against`` (a git revision)
the same modes also run from a checkout of that revision, interleaved with this
tree's runs in the same benchmark: a before/after comparison on one noisy machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..runs import read_metrics
from ..summary import summarise_run

__all__ = ["run_e2e_bench", "format_e2e_table", "history_table", "PAPER_SECONDS_PER_ITERATION"]

PAPER_SECONDS_PER_ITERATION = (180.0, 250.0)
"""The paper's own code (torch RPC, one env) on a 2-core machine like ours, per 4096-step iteration."""

_PHASES = ("time/env", "time/encoder", "time/heads", "time/link_wait")


def _run_mode(mode: str, run_dir: Path, args: Sequence[str], timeout: float, root: Path | None = None) -> None:
    """One run of ``mode``; with ``root``, the splitrl of that source tree."""
    command = [sys.executable, "-m", "splitrl", "run" if mode == "split" else "train", "--run-dir", str(run_dir), *args]
    env = None if root is None else {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=root, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({result.returncode}):\n{result.stderr[-3000:]}")


@contextlib.contextmanager
def checkout(revision: str) -> Iterator[Path]:
    """A temporary git worktree of ``revision`` of the repository this package lives in."""
    repo = Path(__file__).resolve().parents[2]
    path = Path(tempfile.mkdtemp(prefix="splitrl-e2e-rev-")) / "tree"
    done = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(path), revision],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"cannot check out {revision!r} of {repo}: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True)


def run_e2e_bench(
    iterations: int = 1, repeats: int = 1, extra_args: Sequence[str] = (), timeout: float = 3600.0,
    out_dir: str | None = None, against: str | None = None,
) -> list[dict[str, Any]]:
    """One row per (version, mode, repeat): mean over its iterations of wall time, steps/s and phases.

    ``against``: also run every mode from a checkout of this git revision, alternating with this tree.
    """
    with contextlib.ExitStack() as stack:
        versions: list[tuple[str, Path | None]] = [("this", None)]
        if against:
            versions.append((against, stack.enter_context(checkout(against))))
        return _run_versions(versions, iterations, repeats, extra_args, timeout, out_dir)


def _run_versions(versions: list[tuple[str, Path | None]], iterations: int, repeats: int, extra_args: Sequence[str],
                  timeout: float, out_dir: str | None) -> list[dict[str, Any]]:
    # Absolute: a checked-out revision runs in its own tree (a relative --out would land there, and go with it).
    base = Path(out_dir or tempfile.mkdtemp(prefix="splitrl-e2e-")).resolve()
    rows = []
    for repeat in range(repeats):
        modes = ("split", "twin") if repeat % 2 == 0 else ("twin", "split")
        order = versions if repeat % 2 == 0 else versions[::-1]
        for mode, (version, root) in ((m, v) for m in modes for v in order):
            run_dir = base / (f"{mode}-{repeat}" if root is None else f"{mode}-{repeat}-{version}")
            args = ["--total-steps", str(iterations * 4096), *extra_args]
            _run_mode(mode, run_dir, args, timeout, root)
            summary = summarise_run(run_dir, skip_first=False)  # every iteration: the first is part of the cost
            records = read_metrics(run_dir)
            row: dict[str, Any] = {
                "version": version,
                "mode": mode,
                "repeat": repeat,
                "iterations": summary["iterations"],
                "steps": summary["steps"],
                "seconds_per_iteration": summary["seconds_per_iteration"],
                "SPS": summary["steps_per_second"],
                "bytes_per_iteration": summary["bytes_per_iteration"],
                "run_dir": str(run_dir),
            }
            for phase in _PHASES:
                row[phase] = sum(r[phase] for r in records) / len(records)
            rows.append(row)
    return rows


def format_e2e_table(rows: list[dict[str, Any]]) -> str:
    """Markdown, one line per run; 'vs twin' is against the mean twin of the same version."""
    versions = list(dict.fromkeys(r.get("version", "this") for r in rows))
    twin_sps = {}
    for version in versions:
        twin = [r["SPS"] for r in rows if r["mode"] == "twin" and r.get("version", "this") == version]
        twin_sps[version] = sum(twin) / len(twin) if twin else float("nan")
    label = len(versions) > 1
    lines = [
        ("| version " if label else "") + "| mode | repeat | s/iteration | steps/s | vs twin | vs paper (180-250 s) | env s "
        "| encoder s | heads s | link wait s | MB/iteration |",
        ("|---" if label else "") + "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lo, hi = PAPER_SECONDS_PER_ITERATION
    for r in rows:
        spi, version = r["seconds_per_iteration"], r.get("version", "this")
        lines.append(
            (f"| {version} " if label else "")
            + f"| {r['mode']} | {r['repeat']} | {spi:.1f} | {r['SPS']:.1f} | {r['SPS'] / twin_sps[version]:.2f}x "
            f"| {lo / spi:.1f}-{hi / spi:.1f}x faster | {r['time/env']:.1f} | {r['time/encoder']:.1f} "
            f"| {r['time/heads']:.1f} | {r['time/link_wait']:.1f} | {r['bytes_per_iteration'] / 1e6:.0f} |"
        )
    return "\n".join(lines)


def history_table(paths: Sequence[str | Path]) -> str:
    """Markdown, one line per saved bench (``--json`` FILE): this tree's split and twin seconds per iteration in
    that run and split against twin as the main table's 'vs twin' has it (split steps/s over the twin's mean).
    One run's ratio a line: side by side they show how far that ratio moves between runs."""
    lines = ["| run | against | split s/iteration | twin s/iteration | split vs twin |", "|---|---|---:|---:|---:|"]
    for path in map(Path, paths):
        try:
            rows = json.loads(path.read_text())
            mine = [r for r in rows if r.get("version", "this") == "this"]
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not the rows of `splitrl bench e2e --json` ({exc})") from None
        split = [r for r in mine if r["mode"] == "split"]
        twin = [r for r in mine if r["mode"] == "twin"]
        if not split or not twin:
            raise ValueError(f"{path}: no split and twin rows of this tree (not a `splitrl bench e2e --json` file?)")
        against = sorted({str(r["version"])[:7] for r in rows if r.get("version", "this") != "this"})
        ratio = (sum(r["SPS"] for r in split) / len(split)) / (sum(r["SPS"] for r in twin) / len(twin))
        seconds = [" / ".join(f"{r['seconds_per_iteration']:.1f}" for r in part) for part in (split, twin)]
        lines.append(f"| {path.name} | {', '.join(against) or '-'} | {seconds[0]} | {seconds[1]} | {ratio:.2f}x |")
    return "\n".join(lines)
