"""``splitrl bench cuts``: where to cut, predicted by the planner and measured in the lab."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .errors import run_cli

__all__ = ["bench_cuts"]


@click.command("cuts")
@click.option("--models", default="nature,impala", show_default=True, help="comma-separated (splitrl.bench.cut_bench)")
@click.option("--rates", default="10mbit,100mbit", show_default=True, help="the lab's link rates, comma-separated")
@click.option("--iterations", default=3, show_default=True,
              help="iterations per run (the first and the last are left out of the figures)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="keep the run directories here (runs already finished there are not run again)")
@click.option("--table-only", is_flag=True, help="only predict and tabulate the runs already in --out")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
@click.argument("extra", nargs=-1)
def bench_cuts(models: str, rates: str, iterations: int, out_dir: str | None, table_only: bool,
               json_path: str | None, extra: tuple[str, ...]) -> None:
    """Each model's cuts (the observation, a feature map, the default) at each link rate, measured in the lab
    (needs root), and `splitrl plan`'s prediction of each from the default cut at the fastest rate: its
    error, and whether the cut it ranks first is within 10 % of the best measured. Times the networks: run it
    on an idle machine. EXTRA arguments (after --) go to every run."""
    from ..bench.cut_bench import check_cuts, cut_rows, cut_table, run_cut_bench

    from ..bench.cut_bench import MODELS

    model_list = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in model_list if m not in MODELS]
    if unknown:
        raise click.BadParameter(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}",
                                 param_hint="--models")
    rate_list = [r.strip() for r in rates.split(",") if r.strip()]

    def go() -> list:
        if table_only and not out_dir:
            raise click.UsageError("--table-only needs --out")
        base = out_dir if table_only else run_cut_bench(
            model_list, rate_list, iterations, extra, out_dir, echo=lambda line: click.echo(line, err=True))
        return cut_rows(base, model_list, rate_list)

    rows = run_cli(go)
    click.echo(cut_table(rows))
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows, "checks": check_cuts(rows)}, indent=2))
