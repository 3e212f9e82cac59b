"""``splitrl bench lab``: the lab benchmark's command, attached to the ``bench`` group by `register`."""

from __future__ import annotations

import json
import sys

import click

__all__ = ["register", "bench_lab"]

_MIB = 1024 * 1024


@click.command("lab")
@click.option("--rates", default="5mbit,20mbit,100mbit", show_default=True,
              help="comma-separated link rates in tc units; one lab per rate")
@click.option("--quick", is_flag=True,
              help="smoke test: one rate (20mbit unless --rates is given), a 2 MiB throughput payload and a tiny "
                   "training (--total-steps 64 --num-steps 32 --epochs 2 --minibatches 2 --max-episode-steps 20)")
@click.option("--measure", "measure_mib", type=click.FloatRange(min=1), default=None,
              help="MiB for each throughput measurement [default: about 10 s of the rate, 4 to 64 MiB]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="keep the run directories (and each stage's log) here [default: a new temporary directory]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench_lab(ctx: click.Context, rates: str, quick: bool, measure_mib: float | None, out_dir: str | None,
              json_path: str | None, extra: tuple[str, ...]) -> None:
    """Per link rate, in the lab: achieved throughput, and a short PPO run's s/iteration with fp32 and the best codecs.

    The short run is 2 iterations of 512 CarRacing steps, 2 epochs of 4 minibatches,
    --threads 1. EXTRA arguments (after --) go to both stages of every run, e.g.
    -- --timeout 120. Needs root. Roughly 10-20 minutes on an idle 2-core machine: fp32 moves
    about 42 MB per iteration, over a minute of link time per iteration at 5 Mbit/s.
    """
    from ..netem.tc import ShapingError, parse_rate
    from .lab_bench import (
        PPO_ARGS,
        QUICK_MEASURE_BYTES,
        QUICK_PPO_ARGS,
        QUICK_RATES,
        lab_bench_table,
        run_lab_bench,
    )

    rate_given = ctx.get_parameter_source("rates") is not click.core.ParameterSource.DEFAULT
    rate_list = [r.strip() for r in rates.split(",") if r.strip()] if (rate_given or not quick) else list(QUICK_RATES)
    if not rate_list:
        raise click.BadParameter("no rate given", param_hint="--rates")
    for rate in rate_list:
        try:
            parse_rate(rate)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--rates") from None
    if measure_mib is not None:
        measure_bytes: int | None = int(measure_mib * _MIB)
    else:
        measure_bytes = QUICK_MEASURE_BYTES if quick else None
    try:
        rows = run_lab_bench(rate_list, QUICK_PPO_ARGS if quick else PPO_ARGS, measure_bytes=measure_bytes,
                             extra_args=extra, out_dir=out_dir, echo=lambda line: click.echo(line, err=True))
    except (ShapingError, RuntimeError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted; the lab was removed", err=True)
        sys.exit(130)
    click.echo(lab_bench_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)


def register(bench: click.Group) -> None:
    """Attach ``lab`` to the ``splitrl bench`` group."""
    bench.add_command(bench_lab)
