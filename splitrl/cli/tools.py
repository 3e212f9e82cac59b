"""Tool commands: ``splitrl codecs`` and ``splitrl report``."""

from __future__ import annotations

from pathlib import Path

import click

from .errors import run_cli

__all__ = ["codecs_cmd", "report"]


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
    from ..bench.report import make_report

    paths = run_cli(lambda: make_report(run_dirs, out_dir, tensorboard=tensorboard))
    click.echo(paths["table"])
    click.echo(f"\nfigures: {paths['return']}, {paths['bytes']}; table: {paths['markdown']}")
    if tensorboard:
        click.echo(f"tensorboard --logdir {Path(out_dir) / 'tensorboard'}")
