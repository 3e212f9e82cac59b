"""How the commands end: the library's errors become one clear line and an exit code."""

from __future__ import annotations

import sys
from typing import Any, Callable, NoReturn

import click

from ..errors import SettingsError

__all__ = ["run_cli", "fail"]


def fail(exc: BaseException) -> NoReturn:
    """Say what went wrong in one line and exit 1."""
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def run_cli(what: Callable[[], Any]) -> Any:
    """Run ``what``: bad options or settings (`SettingsError`) are a usage error (exit 2); a failure while
    running (a link or peer failure, a bad value, a full disk) is one line and exit 1; Ctrl-C / SIGTERM
    exit 130. Anything else is a bug and keeps its traceback."""
    # Imported here, not at the top: the transport pulls in torch, which `splitrl netem` does not need.
    from ..transport import ProtocolError

    try:
        return what()
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    except (ProtocolError, ValueError, RuntimeError, OSError, TimeoutError, ImportError) as exc:
        # ProtocolError, PeerAbort, TransportTimeout, CheckpointError... and ConnectionError are among these.
        fail(exc)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
