"""One run directory read back whole: its history (`run_history`; a fleet's edges merged into one record per
iteration) and its summary in numbers (`summarise_run`), from the files `splitrl.runs` reads.

Every benchmark and report that compares runs takes its rows from `summarise_run`; the per-iteration means
are over `splitrl.runs.measured_records`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .runs import EMA_DECAY, iteration_bytes, link_bytes, measured_records, read_episodes, read_metrics, run_settings

__all__ = ["RunHistory", "fleet_edges", "has_records", "run_history", "summarise_run", "wall_seconds"]


def fleet_edges(run_dir: str | Path) -> list[Path]:
    """A fleet's run directory (`splitrl run --edges N`: stage1's, with RUN_DIR/edge-K for each edge's records):
    the directories of its edges that wrote records, by K; [] for any other run directory."""
    path = Path(run_dir)
    if (path / "metrics.jsonl").exists():
        return []
    edges = [d for d in path.glob("edge-*") if d.name[5:].isdigit() and (d / "metrics.jsonl").exists()]
    return sorted(edges, key=lambda d: int(d.name[5:]))


def has_records(run_dir: str | Path) -> bool:
    """A run directory with records to read: its own metrics.jsonl, or a fleet's edges' (`fleet_edges`)."""
    return (Path(run_dir) / "metrics.jsonl").is_file() or bool(fleet_edges(run_dir))


def _records_upto(run_dir: Path, upto: int | None) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if upto is None or r["iteration"] <= upto]


@dataclass
class RunHistory:
    """A run directory's iterations and episodes, read back the same way for one run and a fleet."""

    records: list[dict[str, Any]]
    """metrics.jsonl's records; a fleet's merged per iteration (`run_history`)."""
    episodes: list[dict[str, Any]]
    """Finished episodes up to the last record's iteration; a fleet's every edge's, by (global_step, env)."""
    settings_dir: Path
    """Where the run's (stage0's) config is: the run directory, or a fleet's first edge's."""


def run_history(run_dir: str | Path, upto: int | None = None) -> RunHistory:
    """The iterations (up to ``upto``, if given) and episodes of one run directory.

    A fleet's (`fleet_edges`) is merged into one record per iteration any edge recorded (one may have been
    dropped, another joined late), its times and settings those of the edge that went furthest where it has
    a record (else the first edge's that has one); the bytes and messages on the
    links summed over the edges (``net/``: those with a record of the iteration; ``net_total/``: each edge's
    newest, so a dropped edge's link still counts); the returns over every edge's episodes, the EMA taken
    over them as one edge of all the envs takes it. Raises ValueError when there is no iteration.
    """
    edges = fleet_edges(run_dir)
    if not edges:
        records = _records_upto(Path(run_dir), upto)
        if not records:
            raise ValueError(f"{run_dir}: metrics.jsonl has no iterations")
        last = records[-1]["iteration"]
        return RunHistory(records, [e for e in read_episodes(run_dir) if e["iteration"] <= last], Path(run_dir))
    by_edge = {d: {r["iteration"]: r for r in _records_upto(d, upto)} for d in edges}
    furthest = max(edges, key=lambda d: max(by_edge[d], default=0))
    iterations = sorted({i for records in by_edge.values() for i in records})
    if not iterations:
        raise ValueError(f"{run_dir}: no iterations in any edge's metrics.jsonl")
    last = iterations[-1]
    episodes = sorted((e for d in edges for e in read_episodes(d) if e["iteration"] <= last),
                      key=lambda e: (e["global_step"], e["env"]))
    merged: list[dict[str, Any]] = []
    newest: dict[Path, dict[str, Any]] = {}
    ema, taken = None, 0
    for iteration in iterations:
        # Times and the like: the furthest edge's, or (before it joined) the first edge's with a record.
        base = by_edge[furthest].get(iteration) or next(by_edge[d][iteration] for d in edges if iteration in by_edge[d])
        record = {k: v for k, v in base.items() if not k.startswith(("net/", "net_total/"))}
        for d in edges:
            here = by_edge[d].get(iteration)
            if here is not None:
                newest[d] = here
                _add_meters(record, here, "net/")
        for edge_record in newest.values():
            _add_meters(record, edge_record, "net_total/")
        returns = []
        while taken < len(episodes) and episodes[taken]["iteration"] <= iteration:
            returns.append(episodes[taken]["return"])
            ema = returns[-1] if ema is None else EMA_DECAY * ema + (1 - EMA_DECAY) * returns[-1]
            taken += 1
        record.update({"charts/episodic_return": sum(returns) / len(returns) if returns else None,
                       "charts/episodes": len(returns), "charts/episodic_return_ema": ema})
        merged.append(record)
    return RunHistory(merged, episodes, furthest)


def _add_meters(into: dict[str, Any], record: dict[str, Any], prefix: str) -> None:
    for key, value in record.items():
        if key.startswith(prefix):
            into[key] = into.get(key, 0) + value


def summarise_run(
    run_dir: str | Path, last_episodes: int = 20, upto: int | None = None, *, skip_first: bool = True,
    skip_last: bool = False,
) -> dict[str, Any]:
    """One run directory in numbers (a fleet's as `run_history` merges it): totals as of its last iteration,
    means per iteration, returns.

    ``upto``: as of the end of that iteration (to compare runs of different lengths).
    The per-iteration means (``*_per_iteration``, ``steps_per_second``) are over
    `measured_records`. A mean of a metric some iteration lacks is None.
    """
    history = run_history(run_dir, upto)
    records, episodes = history.records, history.episodes
    last = records[-1]
    used = measured_records(records, skip_first, skip_last)
    steps = last.get("global_step")
    total = link_bytes(last)
    tail = [e["return"] for e in episodes[-last_episodes:]]
    settings = run_settings(history.settings_dir)
    codecs = settings.get("codecs", {})
    return {
        "run": Path(run_dir).name,
        "cut": settings.get("cut", "?"),
        # Defaults for committed run configs: learning-check*'s have no codecs (they sent float32, as fp32 does),
        # codec-learning's no exchange (features).
        "codecs": " / ".join(codecs.get(f"codec_{s}", "fp32") for s in ("rollout", "fwd", "bwd"))
        + ("" if codecs.get("exchange", "features") == "features" else f" / {codecs['exchange']}"),
        "iterations": last["iteration"],
        "iterations_used": len(used),
        "steps": steps,
        "total_bytes": total,
        "bytes_per_step": total / steps if steps else None,
        "bytes_per_iteration": sum(iteration_bytes(r) for r in used) / len(used),
        "seconds_per_iteration": _mean(used, "time/iteration"),
        "steps_per_second": _mean(used, "charts/SPS"),
        "link_wait_per_iteration": sum(r.get("time/link_wait", 0.0) for r in used) / len(used),
        "final_ema": last.get("charts/episodic_return_ema"),
        "last_episodes_mean": sum(tail) / len(tail) if tail else None,
        "wall_seconds": wall_seconds(records),
    }


def wall_seconds(records: Sequence[dict[str, Any]]) -> float | None:
    """A run's wall time: ``time/total`` counts from its process's start, so a run resumed N times is the sum of
    each session's last total (where the next record's total is smaller, a new session began)."""
    totals = [r.get("time/total") for r in records]
    if not totals or any(t is None for t in totals):
        return totals[-1] if totals else None
    return sum(here for here, after in zip(totals, [*totals[1:], None]) if after is None or after < here)


def _mean(records: Sequence[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over ``records``; None unless every record has it."""
    values = [r.get(key) for r in records]
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)
