"""How the commands end: the library's errors become one clear line and an exit code."""

from __future__ import annotations

import sys
from typing import Any, Callable, NoReturn

import click

__all__ = ["run_cli", "fail"]


def fail(exc: BaseException) -> NoReturn:
    """Say what went wrong in one line and exit 1."""
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def run_cli(what: Callable[[], Any]) -> Any:
    """Run ``what``: a bad argument (ValueError) is a usage error (exit 2), a link or peer failure exit 1,
    Ctrl-C / SIGTERM exit 130."""
    # Imported here, not at the top: the transport pulls in torch, which `splitrl netem` does not need.
    from ..transport import PeerAbort, ProtocolError, TransportTimeout

    try:
        return what()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except (TransportTimeout, ProtocolError, PeerAbort, ConnectionError, ImportError) as exc:
        fail(exc)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
