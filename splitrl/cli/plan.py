"""``splitrl plan``: predict a configuration's iteration on a link from a measured run, or recommend one."""

from __future__ import annotations

import os

import click

from ..errors import SettingsError
from ..settings import RunOptions, TrainSettings
from .errors import run_cli
from .options import training_options

__all__ = ["plan"]


@click.command()
@click.option("--from", "calibration", required=True, type=click.Path(exists=True, file_okay=False),
              help="a measured synchronous run on these machines (its env steps and its stages' compute calibrate "
                   "the plan)")
@click.option("--bytes-from", "bytes_from", type=click.Path(exists=True, file_okay=False),
              help="a measured run with the planned codecs and cut, for the bytes of each stream (default: --from)")
@click.option("--rate", default="", help="the link's rate as tc sets it, e.g. 2mbit, 1gbit (default: unshaped)")
@click.option("--rtt", default=0.0, show_default=True, help="the link's round trip, ms")
@click.option("--measured-rate", default="", help="the rate the --from run's link had (default: unshaped)")
@click.option("--measured-rtt", default=0.0, show_default=True, help="the round trip the --from run's link had, ms")
@click.option("--cores", default=os.cpu_count() or 1, show_default=True, help="cores of each machine")
@click.option("--separate", is_flag=True,
              help="stage0 and stage1 on two machines (default: one machine's cores, as in every bench here)")
@click.option("--recommend", is_flag=True, help="plan every schedule for these envs and samples, fastest first")
@click.option("--cuts", default=None,
              help="with --recommend, the cuts to rank too: 'all' (every cut of the model; the default where --from "
                   "was cut after a layer), 'none', or names such as input,conv2,cnn (from --from's bytes per value)")
@click.option("--edge-speed", default=1.0, show_default=True,
              help="the edge's speed over the machine that ran stage0 in --from (0.25: four times slower)")
@click.option("--server-speed", default=1.0, show_default=True,
              help="the server's speed over the machine that ran stage1 in --from (4: a GPU server's heads four "
                   "times faster)")
@click.option("--allow-stale", is_flag=True,
              help="with --recommend, the asynchronous schedule too (samples one policy version old: it learns "
                   "differently, docs/benchmarks/pipeline.md)")
@training_options(link=False)
def plan(settings: TrainSettings, options: RunOptions, calibration: str, bytes_from: str | None, rate: str, rtt: float,
         measured_rate: str, measured_rtt: float, cores: int, separate: bool, recommend: bool, cuts: str | None,
         edge_speed: float, server_speed: float, allow_stale: bool) -> None:
    """Predict seconds per iteration, bytes per env step, each stage's busy fraction and staleness of the
    configuration these training options describe, on a link of --rate and --rtt; times the networks here
    for a few seconds (run it on an idle machine). --recommend ranks the schedules, then the cuts
    (`splitrl.cutplan`: each cut's two halves timed here for a few seconds)."""
    from ..envs import choose_vector
    from ..units import parse_rate
    from ..plan import Link, Timings, calibrate, load_run, planned_workers, predict
    from ..plan import recommend as plan_all

    def go() -> None:
        settings.validate(options)
        if not recommend and (cuts is not None or edge_speed != 1.0 or server_speed != 1.0):
            raise SettingsError("--cuts, --edge-speed and --server-speed rank cuts: they go with --recommend")
        link = Link.shaped(parse_rate(rate) if rate else 0.0, rtt / 1000, cores=cores, shared=not separate)
        measured = Link.shaped(parse_rate(measured_rate) if measured_rate else 0.0, measured_rtt / 1000)
        vector = choose_vector(options.vector, settings.env.num_envs)
        timings = Timings(settings, load_run(calibration).spec)
        load = os.getloadavg()[0]
        if load > 0.5:
            click.echo(f"note: load average {load:.2f}: the networks' timings are taken now, on this machine; "
                       "a busy machine skews the plan", err=True)
        click.echo(f"link: {rate or 'unshaped'}, {rtt:g} ms round trip; {cores} cores "
                   f"{'per machine' if separate else 'shared by both stages'}; calibrated on {calibration}")
        if not recommend:
            rates = calibrate(calibration, settings, threads=options.threads, bytes_from=bytes_from, measured_link=measured,
                              timings=timings)
            workers = planned_workers(settings, options.threads, link.cores, options.part_workers)
            click.echo(_table([(settings.schedule.mode, predict(settings, rates, link, vector=vector,
                                                                 workers=workers))]))
            return
        plans = plan_all(settings, calibration, link, vector=vector, bytes_from=bytes_from, allow_stale=allow_stale,
                         measured_link=measured, timings=timings, part_workers=options.part_workers)
        click.echo(_table([(name, p) for name, _, p in plans]))
        lossless = [p for p in plans if p[2].staleness == 0]
        name, _, best = lossless[0]
        click.echo(f"\nrecommended: {name}, {best.seconds:.1f} s an iteration ({plans[-1][2].seconds / best.seconds:.2f}x "
                   f"faster than the slowest here); it changes no learning maths")
        stale_name, _, stale = plans[0]
        if stale.staleness:
            click.echo(f"faster, if learning tolerates samples {stale.staleness:.2g} of an iteration old on average: "
                       f"{stale_name}, "
                       f"{stale.seconds:.1f} s (its rollout takes {stale.balance:.2f} of its training's time: "
                       f"{'the learner is the bound' if stale.balance < 1 else 'the rollout is the bound'})")
        if (cuts or "all").strip() == "none":
            return
        if cuts is None and load_run(calibration).settings.cut.strip() in ("input", "0"):
            click.echo(f"\n(cuts not ranked: {calibration} was cut at the input; rank them from a run cut after a "
                       "layer)")
            return
        _rank_cuts(settings, options, calibration, link, measured, vector, cuts or "all", edge_speed, server_speed)

    run_cli(go)


def _rank_cuts(settings: TrainSettings, options: RunOptions, calibration: str, link, measured, vector: str,
               cuts: str, edge_speed: float, server_speed: float) -> None:
    from ..cutplan import plan_cuts

    only = None if cuts.strip() == "all" else [c.strip() for c in cuts.split(",") if c.strip()]
    plans = plan_cuts(settings, calibration, link, vector=vector, threads=options.threads, only=only,
                      edge_speed=edge_speed, server_speed=server_speed, measured_link=measured)
    click.echo(f"\ncuts ({settings.schedule.mode} schedule; edge x{edge_speed:g}, server x{server_speed:g}):")
    out = ["| cut | values a sample | s/iteration | rollout s | training s | bytes per env step | busy stage0 "
           "| busy stage1 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in plans:
        p = c.plan
        out.append(f"| {c.cut} | {c.values:,} | {p.seconds:.1f} | {p.rollout:.1f} | {p.training:.1f} "
                   f"| {p.bytes_per_step:,.0f} | {p.busy0:.2f} | {p.busy1:.2f} |")
    click.echo("\n".join(out))
    best = plans[0]
    click.echo(f"\nrecommended cut: --cut {best.cut}, {best.plan.seconds:.1f} s an iteration "
               f"({plans[-1].plan.seconds / best.plan.seconds:.2f}x faster than the slowest cut here)")


def _table(plans: list) -> str:
    out = ["| schedule | s/iteration | rollout s | training s | bytes per env step | busy stage0 | busy stage1 "
           "| staleness |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in plans:
        out.append(f"| {name} | {p.seconds:.1f} | {p.rollout:.1f} | {p.training:.1f} | {p.bytes_per_step:,.0f} "
                   f"| {p.busy0:.2f} | {p.busy1:.2f} | {p.staleness:.2g} |")
    return "\n".join(out)
