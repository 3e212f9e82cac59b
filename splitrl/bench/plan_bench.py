"""The planner checked against measured runs: `splitrl bench plan`.

Each check is a benchmark whose rows are runs of one machine state (one bench run, modes back to back):
the planner is calibrated on the bench's synchronous row at 0 ms (its env steps, its stages' compute:
`splitrl.plan.calibrate`) and the networks timed here (`splitrl.plan.Timings`, so run it on an idle
machine), then predicts every row from that row's settings and link alone: the schedule, the envs and
their vector mode, the threads, the link's rate and its round trip (as each row measured it at the start,
``link/rtt_ms``, where the bench has one at that round trip). The error is predicted over measured
seconds per iteration, minus 1 (issue 18's target: within 20 % for every row).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from ..netem.tc import parse_rate
from ..plan import Link, Timings, calibrate, load_run, predict

__all__ = ["CHECKS", "check_plan", "plan_table"]

CHECKS: dict[str, str] = {
    "docs/results/pipeline-latency.json": "1gbit",
    "docs/results/pipeline.json": "100mbit",
}
"""Bench results to check against and the rate their shaped rows ran at (their 0 ms rows ran over loopback)."""


def check_plan(checks: dict[str, str] | None = None, *, root: str | Path = ".",
               echo: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Every row of every bench in ``checks`` (path -> rate), predicted from its bench's sync row at 0 ms."""
    rows: list[dict[str, Any]] = []
    for path, rate in (checks or CHECKS).items():
        measured = json.loads((Path(root) / path).read_text())
        reference = next(r for r in measured if r["mode"] == "sync" and not r["rtt_ms"])
        rtts: dict[float, list[float]] = {}
        for r in measured:
            if r.get("measured_rtt_ms"):
                rtts.setdefault(r["rtt_ms"], []).append(r["measured_rtt_ms"])
        timings = None
        for r in measured:
            run = load_run(Path(root) / r["run_dir"])
            settings = run.settings
            timings = timings or Timings(settings, run.spec)
            seen = rtts.get(r["rtt_ms"])
            rtt = (sum(seen) / len(seen) if seen else r["rtt_ms"]) / 1000
            link = Link(rate=parse_rate(rate) if r["rtt_ms"] else 0.0, rtt=rtt)
            rates = calibrate(Path(root) / reference["run_dir"], settings, threads=run.threads,
                              timings=timings)
            plan = predict(settings, rates, link, vector=run.vector)
            row = {
                "bench": path, "mode": r["mode"], "rtt_ms": r["rtt_ms"], "rate": rate if r["rtt_ms"] else "loopback",
                "link_rtt_ms": rtt * 1000, "measured": r["seconds_per_iteration"], "predicted": plan.seconds,
                "error": plan.seconds / r["seconds_per_iteration"] - 1,
                "measured_bytes_per_step": r["bytes_per_iteration"] / (settings.ppo.num_steps * settings.env.num_envs),
                "plan": plan.as_dict(), "measured_busy": [r["busy_stage0"], r["busy_stage1"]],
                "measured_staleness": r["staleness_mean"], "calibrated_on": reference["run_dir"],
            }
            echo(f"{path} {r['mode']} {r['rtt_ms']} ms: measured {row['measured']:.1f} s, predicted "
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
    worst = max(rows, key=lambda r: abs(r["error"]))
    out.append("")
    out.append(f"Worst row: {Path(worst['bench']).stem} {worst['mode']} at {worst['rtt_ms']} ms, "
               f"{100 * worst['error']:+.1f} %; {sum(abs(r['error']) <= 0.2 for r in rows)} of {len(rows)} rows "
               f"within 20 %.")
    return "\n".join(out)
