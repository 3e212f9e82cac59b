"""``splitrl bench greedy``: which deterministic action plays a trained policy best.

Every rule of `splitrl.models.greedy` and the sampled policy, on the same held-out seeds (`splitrl eval`'s), for
each run given, to weigh `DEFAULT_GREEDY` against the others. Each row is whole episodes, so it is a score, not a timing,
and the machine's load does not move it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models.greedy import DEFAULT_GREEDY, GREEDY_RULES

__all__ = ["run_greedy_bench", "format_table"]

SAMPLED = "sampled"


def run_greedy_bench(run_dirs: list[str], episodes: int, rules: tuple[str, ...] = GREEDY_RULES,
                     seed: int | None = None, log: Any = None) -> list[dict[str, Any]]:
    """One row per (run, rule), the sampled policy last: the returns of ``episodes`` held-out episodes."""
    from ..stages.evaluate import eval_seed, evaluate, load_agent

    rows = []
    for run_dir in run_dirs:
        settings, spec, encoder, heads, iteration = load_agent(run_dir)
        first = eval_seed(settings) if seed is None else seed
        for rule in (*rules, SAMPLED):
            result = evaluate(settings, encoder, heads, spec, episodes=episodes, seed=first,
                              deterministic=rule != SAMPLED, greedy=rule if rule != SAMPLED else DEFAULT_GREEDY)
            rows.append({"run": Path(run_dir).name, "iteration": iteration, "rule": rule, "seed": first,
                         **result.record()})
            if log:
                log(f"{Path(run_dir).name} {rule}: {result.mean:.1f} ± {result.std:.1f}")
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Runs down, rules across: mean ± std of each, and each rule's score as a share of the sampled play's."""
    runs = list(dict.fromkeys(r["run"] for r in rows))
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    cell = {(r["run"], r["rule"]): r for r in rows}
    lines = ["| run | " + " | ".join(rules) + " |", "|---|" + "---:|" * len(rules)]
    for run in runs:
        sampled = cell.get((run, SAMPLED))
        out = []
        for rule in rules:
            r = cell[(run, rule)]
            share = (f" ({r['return_mean'] / sampled['return_mean']:.0%})"
                     if sampled and rule != SAMPLED and sampled["return_mean"] > 0 else "")
            out.append(f"{r['return_mean']:.1f} ± {r['return_std']:.1f}{share}")
        lines.append(f"| {run} | " + " | ".join(out) + " |")
    return "\n".join(lines)
