"""The same run with each of a few option sets, the sets taking turns (A B, then B A, ...), so that a machine whose
speed drifts during the runs moves every set alike.

    python benchmarks/alternate_runs.py --variant "--env-nice 0" --variant "--env-nice 10" \
        [--rounds 2] [--iterations 3] [--out runs/alternate] [-- TRAINING ARGUMENTS FOR EVERY RUN]

Each round runs every variant once (`splitrl run`, no checkpoints), in the order of ``--variant`` in even rounds
and the reverse in odd ones. Printed: each run's iterations after the first (start-up) with their wall seconds
and CPU seconds (both stages and the env workers, from metrics.jsonl), then each variant's mean over them. A
difference smaller than the iterations' spread within a variant is not told apart by this.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from splitrl.runs import measured_records, read_metrics

CPU_KEYS = ("cpu/stage0", "cpu/stage1", "cpu/envs")


def run(arguments: list[str], run_dir: Path, iterations: int) -> list[tuple[float, float]]:
    """(wall s, CPU s) of each iteration after the first of one `splitrl run` (its output in RUN_DIR.log)."""
    command = [sys.executable, "-m", "splitrl", "run", "--run-dir", str(run_dir), "--checkpoint-every", "0",
               "--total-steps", str(4096 * iterations), *arguments]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.with_name(run_dir.name + ".log"), "w") as log:
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{shlex.join(command)} failed: see {log.name}")
    return [(r["time/iteration"], sum(r.get(key, 0.0) for key in CPU_KEYS))
            for r in measured_records(read_metrics(run_dir))]


def main() -> None:
    argv = sys.argv[1:]
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="one option set (quoted), at least two")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3, help="paper iterations a run (the first left out)")
    parser.add_argument("--out", type=Path, default=Path("runs/alternate"))
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if len(args.variant) < 2 or args.iterations < 2:
        parser.error("give at least two --variant and --iterations 2 or more")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty")
    seen: dict[str, list[tuple[float, float]]] = {variant: [] for variant in args.variant}
    print(f"every run: {shlex.join(common)}")
    for round_ in range(args.rounds):
        order = args.variant if round_ % 2 == 0 else args.variant[::-1]
        for variant in order:
            index = args.variant.index(variant)
            figures = run([*common, *shlex.split(variant)], args.out / f"round{round_}-variant{index}", args.iterations)
            seen[variant] += figures
            shown = ", ".join(f"{wall:.2f} s {cpu:.2f} CPU-s" for wall, cpu in figures)
            print(f"round {round_}  {variant:<30} {shown}", flush=True)
    print("\n| variant | iterations | s / iteration: mean (range) | CPU s: mean (range) |\n|---|---:|---|---|")
    for variant, figures in seen.items():
        walls, cpus = [f[0] for f in figures], [f[1] for f in figures]
        print(f"| {variant} | {len(figures)} | {sum(walls) / len(walls):.2f} ({min(walls):.2f}-{max(walls):.2f}) "
              f"| {sum(cpus) / len(cpus):.2f} ({min(cpus):.2f}-{max(cpus):.2f}) |")


if __name__ == "__main__":
    main()
