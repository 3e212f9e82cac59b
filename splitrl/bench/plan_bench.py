"""The planner checked against measured runs: `splitrl bench plan`.

Each check is a benchmark whose rows are runs of one machine state (one bench run, modes back to back):
the planner is calibrated on one reference row (the pipeline benches: the synchronous row at 0 ms; the lab:
the fixed codecs at 20 Mbit/s) for its env steps and its stages' compute (`splitrl.plan.calibrate`) and the
networks timed here (`splitrl.plan.Timings`, so run it on an idle
machine), then predicts every row from that row's settings and link alone: the schedule, the envs and
their vector mode, the threads, the link's rate and its round trip (as each row measured it at the start,
``link/rtt_ms``, where the bench has one at that round trip). The error is predicted over measured
seconds per iteration, minus 1 (the planner's target: within 20 % for every row).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..units import parse_rate
from ..plan import Link, Timings, calibrate, load_run, planned_workers, predict

__all__ = ["CHECKS", "Check", "check_plan", "plan_table"]

@dataclass(frozen=True)
class Check:
    """One bench's rows to predict: ``rate`` the shaped rows' rate (None: each row's own ``rate``), ``reference``
    the row to calibrate on, ``include`` the rows to predict."""

    path: str
    rate: str | None
    reference: Callable[[dict[str, Any]], bool]
    include: Callable[[dict[str, Any]], bool] = lambda row: True


CHECKS = (
    Check("docs/results/pipeline-latency.json", "1gbit", lambda r: r["mode"] == "sync" and not r["rtt_ms"]),
    Check("docs/results/pipeline.json", "100mbit", lambda r: r["mode"] == "sync" and not r["rtt_ms"]),
    # A cut whose bytes fit 100 Mbit/s (a 256-wide bottleneck, bf16 codecs): latency, not the rate, at 20 ms.
    Check("docs/results/pipeline-thin.json", "100mbit", lambda r: r["mode"] == "sync" and not r["rtt_ms"]),
    # The lab's fixed codecs at 2 and 5 Mbit/s from its 20 Mbit/s run (the budgeted rows change codecs as they go).
    Check("docs/results/lab-budget.json", None, lambda r: r["config"] == "fixed" and r["rate"] == "20mbit",
          lambda r: r["config"] == "fixed"),
)
"""Bench results to check against (the pipeline benches' 0 ms rows ran over loopback)."""


def check_plan(checks: Sequence[Check] = CHECKS, *, root: str | Path = ".",
               echo: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Every included row of every check's bench, predicted from the bench's reference row."""
    rows: list[dict[str, Any]] = []
    for check in checks:
        path = Path(root) / check.path
        if not path.exists():
            echo(f"{check.path}: not there, skipped")
            continue
        measured = json.loads(path.read_text())
        reference = next(r for r in measured if check.reference(r))
        rtts: dict[float, list[float]] = {}
        for r in measured:
            if r.get("measured_rtt_ms"):
                rtts.setdefault(r["rtt_ms"], []).append(r["measured_rtt_ms"])

        def shaped(r: dict[str, Any]) -> tuple[str, Link]:
            """(the rate's name, the link) of row ``r``."""
            rtt_ms = r.get("rtt_ms", 0.0)
            seen = rtts.get(rtt_ms)
            rtt = (sum(seen) / len(seen) if seen else rtt_ms) / 1000
            rate = r["rate"] if check.rate is None else check.rate if rtt_ms else ""
            return rate or "loopback", Link.shaped(parse_rate(rate) if rate else 0.0, rtt)

        _, measured_link = shaped(reference)
        timings = None
        for r in filter(check.include, measured):
            run = load_run(Path(root) / r["run_dir"])
            timings = timings or Timings(run.settings, run.spec)
            rate, link = shaped(r)
            rates = calibrate(Path(root) / reference["run_dir"], run.settings, threads=run.threads,
                              measured_link=measured_link, timings=timings)
            plan = predict(run.settings, rates, link, vector=run.vector,
                           workers=planned_workers(run.settings, run.threads, link.cores, run.part_workers))
            mode = r.get("mode") or r["config"]
            row = {
                "bench": check.path, "mode": mode, "rtt_ms": r.get("rtt_ms", 0.0), "rate": rate,
                "link_rtt_ms": link.rtt * 1000, "measured": r["seconds_per_iteration"], "predicted": plan.seconds,
                "error": plan.seconds / r["seconds_per_iteration"] - 1,
                "measured_bytes_per_step": r["bytes_per_iteration"] / run.settings.steps_per_iteration,
                "plan": plan.as_dict(), "measured_staleness": r.get("staleness_mean", 0.0),
                "calibrated_on": reference["run_dir"],
            }
            echo(f"{check.path} {mode} {rate} {row['rtt_ms']} ms: measured {row['measured']:.1f} s, predicted "
                 f"{row['predicted']:.1f} s ({100 * row['error']:+.1f} %)")
            rows.append(row)
    return rows


def plan_table(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| bench | round trip | rate | mode | measured s/it | predicted s/it | error | predicted rollout / training s "
           "| balance | bytes/step measured / predicted | staleness measured / predicted |",
           "|---|---:|---|---|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        p = r["plan"]
        out.append(f"| {Path(r['bench']).stem} | {r['link_rtt_ms']:.1f} ms | {r['rate']} | {r['mode']} "
                   f"| {r['measured']:.1f} | {r['predicted']:.1f} | {100 * r['error']:+.1f} % "
                   f"| {p['rollout']:.1f} / {p['training']:.1f} | {p['balance']:.2f} "
                   f"| {r['measured_bytes_per_step']:,.0f} / {p['bytes_per_step']:,.0f} "
                   f"| {r['measured_staleness']:.2f} / {p['staleness']:.2f} |")
    if not rows:
        return "\n".join(out + ["", "No rows: none of the benches' results are there (run from the repository's root)."])
    worst = max(rows, key=lambda r: abs(r["error"]))
    out.append("")
    out.append(f"Worst row: {Path(worst['bench']).stem} {worst['mode']} at {worst['rtt_ms']} ms, "
               f"{100 * worst['error']:+.1f} %; {sum(abs(r['error']) <= 0.2 for r in rows)} of {len(rows)} rows "
               f"within 20 %.")
    return "\n".join(out)
