"""Tool commands: ``splitrl codecs``, ``splitrl report``, ``splitrl keys`` and ``splitrl upgrade-checkpoints``."""

from __future__ import annotations

from pathlib import Path

import click

from .errors import run_cli

__all__ = ["codecs_cmd", "report", "keys", "upgrade_checkpoints"]


@click.command("codecs")
def codecs_cmd() -> None:
    """List the wire codecs, the streams each can carry, and their parameters."""
    from ..codecs import catalogue

    click.echo(catalogue())


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="where return.png, bytes.png and report.md go")
@click.option("--tensorboard", is_flag=True, help="also write TensorBoard event files under OUT/tensorboard/")
def report(run_dirs: tuple[str, ...], out_dir: str, tensorboard: bool) -> None:
    """The paper's two figures (return and bytes on the link against env steps) and a table, for RUN_DIRS."""
    from ..report import make_report
    from ..summary import has_records

    missing = [d for d in run_dirs if not has_records(d)]
    if missing:  # a wrong argument, not a failure while running
        raise click.BadParameter(f"no metrics.jsonl in {', '.join(missing)} nor in its edges' directories "
                                 "(not a run directory?)",
                                 param_hint="RUN_DIRS")
    paths = run_cli(lambda: make_report(run_dirs, out_dir, tensorboard=tensorboard))
    click.echo(paths["table"])
    click.echo(f"\nfigures: {paths['return']}, {paths['bytes']}; table: {paths['markdown']}")
    if tensorboard:
        click.echo(f"tensorboard --logdir {Path(out_dir) / 'tensorboard'}")


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="stage0", show_default=True,
              help="the edge's key name; run again with another name for each further edge")
def keys(directory: str, name: str) -> None:
    """Make CURVE keys for `--curve DIRECTORY`: stage1's pair (once) and an edge's pair.

    Copy DIRECTORY to both machines, then delete stage1.key_secret from the edge's copy and the
    edges' *.key_secret from the server's: stage1 needs its secret and authorized/, stage0 its own
    secret and stage1.key."""
    from ..transport.curve import make_keys

    for path in run_cli(lambda: make_keys(directory, name)):
        click.echo(str(path))


@click.command("upgrade-checkpoints")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
def upgrade_checkpoints(run_dirs: tuple[str, ...]) -> None:
    """Rewrite the checkpoints an older splitrl wrote in RUN_DIRS (pickled numpy arrays and deques) as tensors and
    plain values, which is all splitrl loads. Only for runs you trust: the upgrade itself reads nothing but numpy
    arrays, scalars and deques, but what a checkpoint holds decides what the resumed run does."""
    from ..runs import upgrade_checkpoints as upgrade

    for run_dir in run_dirs:
        done = run_cli(lambda: upgrade(run_dir))
        click.echo(f"{run_dir}: {len(done)} checkpoint(s) rewritten")
