"""Each process's CPU seconds an iteration against the parts that are its own, from `splitrl bench pipeline
--json` files (the floor measured in the same bench run; rows that compute their parts otherwise, with
``--channels-last`` or on two intra-op threads, have their own parts too).

    python benchmarks/tax_table.py docs/results/pipeline-floor-session35-sync.json ...

One markdown row per bench row: seconds an iteration and its ratio to the bench's (eager) floor on the machine's
cores; stage0's, stage1's and the env workers' CPU seconds with how far each is above its parts (stage0 owns the
encoder's parts, and the envs' where they step in its process; stage1 the heads'; the workers the envs'; the
twin's one process, all of them, in stage0's column); all
processes together, and their ratio to all the parts: their own, and the floor's (the paper's kernels on one
thread). The next two columns give the range over the iterations the figures are the mean of (a bench run with
``--iterations N`` uses N - 2 of them): each iteration's seconds and its CPU over the parts. The last sets the row's
CPU against each of the two timings of its parts that "x parts" takes the mean of, the one right before the row and
the one right after (`splitrl bench pipeline` records them as ``bracket``; empty for a bench that timed its parts
once): how far the verdict moves with the machine while the row ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from splitrl.runs import is_twin, iteration_cpu, measured_records, read_metrics

HEADER = ("| run | s/iteration | x floor | stage0 | stage1 | env workers | CPU s | x parts | x the floor's parts "
          "| iterations: s | iterations: x parts | x parts: before, after |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def spread(values: list[float], digits: int, suffix: str = "") -> str:
    """``values`` as 'low-high' (one value alone as itself), with ``digits`` decimals."""
    low, high = min(values), max(values)
    return f"{low:.{digits}f}{suffix}" if len(values) == 1 else f"{low:.{digits}f}-{high:.{digits}f}{suffix}"


def run_dir(path: str | Path, row: dict) -> Path:
    """Where a bench row's run records are: its ``run_dir`` as the bench wrote it, or, where that is gone (a clone
    of the repository, which keeps no ``runs/``), the copy kept beside the JSON (``scripts/keep_run.sh`` into the
    directory of the JSON's name: ``one-run-s39.json``'s rows in ``one-run-s39/``)."""
    written = Path(row["run_dir"])
    kept = Path(path).with_suffix("") / written.name
    return written if (written / "metrics.jsonl").is_file() or not (kept / "metrics.jsonl").is_file() else kept


def rows(path: str | Path) -> list[str]:
    out = []
    for row in json.loads(Path(path).read_text()):
        floor, parts = row["floor"], row.get("parts", row["floor"])
        where = run_dir(path, row)
        used = measured_records(read_metrics(where), skip_last=True)
        cpu = {k: sum(r.get(f"cpu/{k}", 0.0) for r in used) / len(used) for k in ("stage0", "stage1", "envs")}
        p = parts["parts"]
        workers = cpu["envs"] > 0
        own = {"stage0": p["encoder acting"] + p["encoder training"] + (0.0 if workers else p["envs"]),
               "stage1": p["heads acting"] + p["heads training"], "envs": p["envs"] if workers else 0.0}
        if is_twin(where):  # one process, its CPU recorded as both stages' (`iteration_cpu`): stage0's column
            cpu["stage1"], own["stage0"], own["stage1"] = 0.0, own["stage0"] + own["stage1"], 0.0
        cells = [f"{cpu[k]:.1f} ({cpu[k] - own[k]:+.1f} over {own[k]:.1f})" if own[k] or cpu[k] else ""
                 for k in ("stage0", "stage1", "envs")]
        total = sum(cpu.values())
        each = [iteration_cpu(r, is_twin(where)) for r in used]
        name = f"{row['mode']} ({Path(path).stem})"
        beside = ", ".join(f"{total / t:.2f}x" for t in parts.get("bracket", []))
        out.append(f"| {name} | {row['seconds_per_iteration']:.1f} | {row['seconds_per_iteration'] / floor['floor']:.2f}x "
                   f"| {' | '.join(cells)} | {total:.1f} | {total / parts['total']:.2f}x (of {parts['total']:.1f}) "
                   f"| {total / floor['total']:.2f}x (of {floor['total']:.1f}) "
                   f"| {spread([r['time/iteration'] for r in used], 1)} "
                   f"| {spread([c / parts['total'] for c in each], 2, 'x')} | {beside} |")
    return out


if __name__ == "__main__":
    print(HEADER)
    for arg in sys.argv[1:]:
        print("\n".join(rows(arg)))
