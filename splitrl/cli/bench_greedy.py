"""``splitrl bench greedy``: which deterministic action plays a trained policy best, on held-out seeds."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..settings.specs import GREEDY_RULES
from .errors import run_cli

__all__ = ["bench_greedy"]


@click.command("greedy")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--episodes", default=10, show_default=True, type=click.IntRange(min=1), help="episodes per rule")
@click.option("--seed", type=int, help="episode k starts from seed + k  [default: each run's held-out seeds]")
@click.option("--threads", default=1, show_default=True, help="torch intra-op threads (0: torch's default)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
def bench_greedy(run_dirs: tuple[str, ...], episodes: int, seed: int | None, threads: int,
                 json_path: str | None) -> None:
    """Each greedy rule (expected, mode, mean) and the sampled policy of each run's newest checkpoints, on the
    same held-out episodes (those of `splitrl eval`); nothing is written into the runs."""
    from ..bench.greedy_bench import format_table, run_greedy_bench

    def go() -> list[dict]:
        import torch

        if threads:
            torch.set_num_threads(threads)
        return run_greedy_bench(list(run_dirs), episodes, GREEDY_RULES, seed, log=lambda s: click.echo(s, err=True))

    rows = run_cli(go)
    click.echo(format_table(rows))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))
