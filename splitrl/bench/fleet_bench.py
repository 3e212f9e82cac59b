"""``splitrl bench fleet``: real edges on loopback, one stage1.

The paper network and schedule (10 epochs of 32 minibatches) with each edge stepping one
CarRacing env for ``num_steps`` steps an iteration, for 1, 2 and 4 edges: one edge is
the plain pair (`splitrl.schedule.sync`), more are a fleet (`splitrl.schedule.fleet`).
Each run is a fresh ``splitrl run --edges N``; the figures are means over the iterations
after the first (`splitrl.runs.measured_records`): samples per second at the learner (the
fleet's samples an iteration over its seconds), each process's busy fraction (its CPU
seconds over wall seconds: 1.0 is one core), and each edge's bytes an iteration.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from ..launch import progress, run_local
from ..runs import iteration_bytes, measured_records, read_metrics

__all__ = ["run_fleet_bench", "fleet_rows", "fleet_table"]


def _edge_dirs(run_dir: Path, edges: int) -> list[Path]:
    return [run_dir] if edges == 1 else [run_dir / f"edge-{k}" for k in range(edges)]


def _summary(edges: int, run_dir: Path) -> dict[str, Any]:
    per_edge = [measured_records(read_metrics(d)) for d in _edge_dirs(run_dir, edges)]

    def mean(records: Sequence[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in records) / len(records)

    first = per_edge[0]
    seconds = mean(first, "time/iteration")
    return {
        "edges": edges,
        "samples_per_second": mean(first, "charts/SPS"),
        "seconds_per_iteration": seconds,
        "busy_stage1": sum(r["cpu/stage1"] / r["time/iteration"] for r in first) / len(first),
        "busy_edges": [sum(r["cpu/stage0"] / r["time/iteration"] for r in rs) / len(rs) for rs in per_edge],
        "bytes_per_iteration_per_edge": [sum(iteration_bytes(r) for r in rs) / len(rs) for rs in per_edge],
        "link_wait": [mean(rs, "time/link_wait") for rs in per_edge],
        "iterations_used": len(first),
        "run_dir": str(run_dir),
    }


def _name(edges: int) -> str:
    return f"{edges}-edges"


def fleet_rows(out_dir: str | Path, edge_counts: Sequence[int] = (1, 2, 4)) -> list[dict[str, Any]]:
    """The rows of the runs already in ``out_dir``."""
    return [_summary(n, Path(out_dir) / _name(n)) for n in edge_counts
            if (_edge_dirs(Path(out_dir) / _name(n), n)[0] / "metrics.jsonl").is_file()]


def run_fleet_bench(edge_counts: Sequence[int] = (1, 2, 4), iterations: int = 3, num_steps: int = 1024,
                    extra_args: Sequence[str] = (), out_dir: str | None = None, timeout: float = 7200.0,
                    echo: Callable[[str], Any] = print) -> list[dict[str, Any]]:
    """One fresh run per edge count, one after another."""
    base = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="splitrl-fleet-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in edge_counts:
        run_dir = base / _name(n)
        args = ["--edges", str(n), "--num-envs", "1", "--num-steps", str(num_steps),
                "--total-steps", str(num_steps * n * iterations), "--checkpoint-every", "0", "--threads", "1",
                *extra_args]
        echo(f"{run_dir.name}: {' '.join(args)}")
        with progress(_edge_dirs(run_dir, n)[0], iterations, run_dir.name):
            run_local(args, run_dir, timeout)
        rows.append(_summary(n, run_dir))
        echo(f"  {rows[-1]['samples_per_second']:.1f} samples/s")
    return rows


def fleet_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown, one line per edge count; 'x 1 edge' is samples/s over the one-edge run's."""
    one = next((r["samples_per_second"] for r in rows if r["edges"] == 1), None)
    lines = ["| edges | samples/s | x 1 edge | s/iteration | busy stage1 | busy per edge | MB/iteration per edge "
             "| link wait s per edge |",
             "|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        ratio = f"{r['samples_per_second'] / one:.2f}" if one else ""
        lines.append(
            f"| {r['edges']} | {r['samples_per_second']:.1f} | {ratio} | {r['seconds_per_iteration']:.1f} "
            f"| {r['busy_stage1']:.2f} | {' / '.join(f'{b:.2f}' for b in r['busy_edges'])} "
            f"| {' / '.join(f'{b / 1e6:.0f}' for b in r['bytes_per_iteration_per_edge'])} "
            f"| {' / '.join(f'{w:.1f}' for w in r['link_wait'])} |")
    return "\n".join(lines)
