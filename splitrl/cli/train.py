"""Training commands: ``splitrl stage0``, ``stage1``, ``train``, ``run`` and ``curve``."""

from __future__ import annotations

import dataclasses
import sys

import click
from click.core import ParameterSource

from ..settings import RunOptions, SettingsError, TrainSettings
from .errors import run_cli
from .options import stage_argv, training_options

__all__ = ["stage0", "stage1", "train", "run", "curve"]


def _device_option(role: str):
    return click.option("--device", default=None, metavar="DEVICE",
                        help=f"where this stage computes: cpu, cuda, cuda:N or auto (--{role}-device's shorthand; "
                             "default cpu)")


def _with_device(options: RunOptions, role: str, device: str | None) -> RunOptions:
    """``options`` with ``--device`` as this stage's device; SettingsError if ``--ROLE-device`` says otherwise."""
    if device is None:
        return options
    field = f"{role}_device"
    given = click.get_current_context().get_parameter_source(field) not in (ParameterSource.DEFAULT, None)
    if given and getattr(options, field) != device:
        raise SettingsError(f"--device {device} and --{role}-device {getattr(options, field)} contradict each other")
    return dataclasses.replace(options, **{field: device})


@click.command()
@click.option("--connect", default="tcp://127.0.0.1:5555", show_default=True,
              help="stage1's endpoint (tcp://HOST:PORT uses PORT and PORT+1; also ipc://PATH)")
@_device_option("stage0")
@training_options
def stage0(settings: TrainSettings, options: RunOptions, connect: str, device: str | None) -> None:
    """The edge: environments + encoder. Drives the schedule."""
    from ..runner import run_stage0

    run_cli(lambda: run_stage0(settings, _with_device(options, "stage0", device), connect))


@click.command()
@click.option("--bind", default="tcp://127.0.0.1:5555", show_default=True,
              help="where to listen (tcp://HOST:PORT binds PORT and PORT+1; also ipc://PATH); an address beyond "
                   "this machine needs --curve (or --insecure)")
@_device_option("stage1")
@training_options
def stage1(settings: TrainSettings, options: RunOptions, bind: str, device: str | None) -> None:
    """The server: actor-critic heads + PPO learner. Serves one stage0 session."""
    from ..runner import run_stage1

    run_cli(lambda: run_stage1(settings, _with_device(options, "stage1", device), bind))


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
    from ..runner.precheck import first_problems
    from .fork import preforked

    def go() -> int:
        # The env id and the run directory are checked before torch loads, and told at once (a fraction of a
        # second) if wrong; once they pass, every other problem either stage would find is found here.
        problems = first_problems(settings, options, "stage1")
        if problems:
            raise SettingsError.of(problems)
        from ..runner.rundir import LAUNCHER, check
        # Every problem either stage would find is found here, before either starts; one torch thread
        # builds the network to check faster on a busy machine than several. Then the stages are forked from
        # here (they share this process's imports), with torch's thread count as it was.
        from ..devices import one_thread

        with one_thread():
            placed = dataclasses.replace(options, run_dir=options.run_dir_for(settings.env.env_id))
            check(settings, placed, LAUNCHER)
            stage_args, run_dir = stage_argv(settings, placed)
        # Not for a stage on cuda: the check touched CUDA here, and a forked child cannot initialise it again.
        on_cuda = any(str(options.device(stage)).startswith("cuda") for stage in ("stage0", "stage1"))
        count = 0 if on_cuda else settings.schedule.edges + (options.learners == 1)
        with preforked(count, click.get_current_context().find_root().command,
                       settings.env.env_id) as forked:
            return launch_split(stage_args, run_dir, endpoint=endpoint, edges=settings.schedule.edges,
                                resume=bool(options.resume), learners=options.learners, forked=forked)

    sys.exit(run_cli(go))


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def curve(run_dir: str) -> None:
    """Print a run's learning curve (per iteration) as a markdown table."""
    from ..report import curve_table

    click.echo(run_cli(lambda: curve_table(run_dir)))
