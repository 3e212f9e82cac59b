"""Training commands: ``splitrl stage0``, ``stage1``, ``train``, ``run`` and ``curve``."""

from __future__ import annotations

import sys

import click

from ..settings import RunOptions, TrainSettings
from .errors import run_cli
from .options import stage_argv, training_options

__all__ = ["stage0", "stage1", "train", "run", "curve"]


@click.command()
@click.option("--connect", default="tcp://127.0.0.1:5555", show_default=True,
              help="stage1's endpoint (tcp://HOST:PORT uses PORT and PORT+1; also ipc://PATH)")
@training_options
def stage0(settings: TrainSettings, options: RunOptions, connect: str) -> None:
    """The edge: environments + encoder. Drives the schedule."""
    from ..runner import run_stage0

    run_cli(lambda: run_stage0(settings, options, connect))


@click.command()
@click.option("--bind", default="tcp://127.0.0.1:5555", show_default=True,
              help="where to listen (tcp://HOST:PORT binds PORT and PORT+1; also ipc://PATH); an address beyond "
                   "this machine needs --curve (or --insecure)")
@training_options
def stage1(settings: TrainSettings, options: RunOptions, bind: str) -> None:
    """The server: actor-critic heads + PPO learner. Serves one stage0 session."""
    from ..runner import run_stage1

    run_cli(lambda: run_stage1(settings, options, bind))


@click.command()
@training_options(link=False)
def train(settings: TrainSettings, options: RunOptions) -> None:
    """Both stages in one process over an in-process link (the single-process twin)."""
    from ..runner import train_twin

    run_cli(lambda: train_twin(settings, options))


@click.command()
@click.option("--endpoint", default=None,
              help="where stage1 binds and stage0 connects, e.g. ipc:///tmp/link  [default: a free loopback tcp port pair]")
@training_options
def run(settings: TrainSettings, options: RunOptions, endpoint: str | None) -> None:
    """Split training on this machine: stage1 and stage0 as two processes over loopback (a stage0 per edge with
    --edges N, each in RUN_DIR/edge-K)."""
    from ..launch import launch_split

    def go() -> int:
        stage_args, run_dir = stage_argv(settings, options)
        return launch_split(stage_args, run_dir, endpoint=endpoint, edges=settings.schedule.edges,
                            resume=bool(options.resume), learners=options.learners)

    sys.exit(run_cli(go))


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def curve(run_dir: str) -> None:
    """Print a run's learning curve (per iteration) as a markdown table."""
    from ..report import curve_table

    click.echo(run_cli(lambda: curve_table(run_dir)))
