"""Shaping commands: ``splitrl netem apply|clear|show`` and ``splitrl lab`` (the two-namespace lab).

Neither imports torch: ``lab`` starts the stages as processes.
"""

from __future__ import annotations

import shlex
import sys
from typing import Callable

import click

from ..netem.tc import (
    ShapingError,
    Shaping,
    apply_shaping,
    clear_command,
    clear_shaping,
    format_plan,
    plan_shaping,
    show_shaping,
)
from ..settings import RunOptions, TrainSettings
from .errors import fail
from .options import stage_argv, training_options

__all__ = ["netem", "lab"]

_MIB = 1024 * 1024


def _shaping(rate: str | None, delay: str | None, jitter: str | None, loss: str | None, limit: int | None) -> Shaping:
    try:
        return Shaping.parse(rate, delay, jitter, loss, limit)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _shaping_options(rate_default: str | None) -> Callable[[Callable], Callable]:
    """--rate/--delay/--jitter/--loss/--limit/--allow-partial, shared by `netem apply` and `lab`."""
    options = [
        click.option("--rate", default=rate_default, show_default=rate_default is not None,
                     help="link rate, tc units: 20mbit, 500kbit, 1gbit, 2mbps (bytes/s)"),
        click.option("--delay", help="delay added to every packet, e.g. 20ms (netem; where the kernel has none, `splitrl lab` adds it with a TCP relay, splitrl/netem/relay.py)"),
        click.option("--jitter", help="random variation of the delay, e.g. 5ms (needs --delay; netem or, in the lab, the relay)"),
        click.option("--loss", help="random packet loss, e.g. 0.1% (needs netem)"),
        click.option("--limit", type=click.IntRange(min=1),
                     help="queue limit in packets [default: one 1 MiB message plus the rate x delay in flight]"),
        click.option("--allow-partial", is_flag=True,
                     help="where the kernel has no netem, apply the rate with tbf even though delay, jitter or "
                          "loss cannot be applied (default: refuse and change nothing)"),
    ]

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


_dev_option = click.option("--dev", required=True, metavar="IF", help="the network interface, e.g. eth0")
_netns_option = click.option("--netns", metavar="NAME", help="the interface is in this network namespace (ip netns)")


@click.group()
def netem() -> None:
    """Shape an interface's outgoing traffic with tc: netem, or tbf (rate only) where the kernel has no netem.

    Needs root (or CAP_NET_ADMIN). Shaping applies to what the interface sends;
    shape both ends (or use `splitrl lab`) for both directions.
    """


@netem.command("apply")
@_dev_option
@_shaping_options(rate_default=None)
@click.option("--dry-run", is_flag=True, help="print the tc commands (netem and the tbf fallback), change nothing")
@_netns_option
def netem_apply(dev: str, rate: str | None, delay: str | None, jitter: str | None, loss: str | None,
                limit: int | None, allow_partial: bool, dry_run: bool, netns: str | None) -> None:
    """Replace IF's root qdisc with the requested shaping."""
    shaping = _shaping(rate, delay, jitter, loss, limit)
    try:
        plan = plan_shaping(dev, shaping, netns)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if dry_run:
        click.echo(format_plan(plan))
        return
    try:
        applied = apply_shaping(plan, allow_partial=allow_partial)
    except ShapingError as exc:
        fail(exc)
    click.echo(f"shaped {applied.summary()}")
    for note in applied.notes:
        click.echo(f"note: {note}", err=True)
    if applied.not_applied:
        click.echo(f"warning: not applied: {', '.join(applied.not_applied)} (no netem qdisc in this kernel)", err=True)


@netem.command("clear")
@_dev_option
@click.option("--dry-run", is_flag=True, help="print the tc command, change nothing")
@_netns_option
def netem_clear(dev: str, dry_run: bool, netns: str | None) -> None:
    """Remove the netem or tbf root qdisc from IF (the kernel's default comes back)."""
    if dry_run:
        click.echo(shlex.join(clear_command(dev, netns)))
        return
    try:
        click.echo(clear_shaping(dev, netns))
    except ShapingError as exc:
        fail(exc)


@netem.command("show")
@_dev_option
@_netns_option
def netem_show(dev: str, netns: str | None) -> None:
    """Say what shaping is in place on IF."""
    try:
        click.echo(show_shaping(dev, netns))
    except ShapingError as exc:
        fail(exc)


@click.command("lab")
@_shaping_options(rate_default="20mbit")
@click.option("--measure", "measure_mib", type=click.FloatRange(min=0), default=8.0, show_default=True,
              help="MiB sent stage0 -> stage1 in 1 MiB messages to measure the throughput before training (0: skip)")
@click.option("--port", type=click.IntRange(1, 65534), default=5555, show_default=True,
              help="stage1's port inside its namespace (uses PORT and PORT+1)")
@click.option("--dry-run", is_flag=True, help="print every command the lab would run, change nothing")
@click.option("--clean", is_flag=True,
              help="only remove namespaces left behind by killed labs (splitrl-s0-*, splitrl-s1-*), then exit; "
                   "not while another lab runs")
@training_options
def lab(settings: TrainSettings, options: RunOptions, rate: str, delay: str | None, jitter: str | None,
        loss: str | None, limit: int | None, allow_partial: bool, measure_mib: float, port: int, dry_run: bool,
        clean: bool) -> None:
    """Split training between two network namespaces joined by a shaped veth pair.

    stage1 runs in one namespace, stage0 in the other, with the given training
    settings; the link is shaped alike in both directions. Prints the achieved
    throughput and each side's application bytes beside the kernel's interface
    counters. Everything is removed on exit (normal end, failure or Ctrl-C).
    Needs root.
    """
    from ..lab import format_report, run_lab, stage_commands
    from ..netem.netns import LabNames, delete_namespace, format_lab_plan, lab_namespaces

    shaping = _shaping(rate, delay, jitter, loss, limit)
    if clean:
        try:
            for ns in lab_namespaces():
                delete_namespace(ns)
                click.echo(f"removed {ns}")
        except (ShapingError, OSError) as exc:
            fail(exc)
        return
    try:
        stage_args, run_dir = stage_argv(settings, options, absolute=True)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    names = LabNames.random()
    if dry_run:
        click.echo(format_lab_plan(names, shaping, stage_commands(stage_args, port, rate_bits=shaping.rate)))
        return
    try:
        result = run_lab(stage_args, run_dir, shaping, allow_partial=allow_partial, measure_bytes=int(measure_mib * _MIB),
                         port=port, names=names, echo=click.echo)
    except (ShapingError, RuntimeError) as exc:
        fail(exc)
    except KeyboardInterrupt:
        click.echo("interrupted; the lab was removed", err=True)
        sys.exit(130)
    report = format_report(result)
    if report:
        click.echo(report)
    click.echo(f"run directory: {run_dir}; lab {names.tag} removed")
    sys.exit(result.code)
