"""How the commands end: the library's errors become one clear line and an exit code."""

from __future__ import annotations

import os
import sys
from typing import IO, Any, Callable, NoReturn

import click

from ..errors import SettingsError
from ..launch import SUPERVISED_ENV

__all__ = ["run_cli", "fail", "OptionError"]


class OptionError(click.ClickException):
    """Options or settings that cannot be used (`SettingsError`), said as ``error: ...`` and exit 2, click's code
    for a usage error. No usage block: the problem is a value, not how the command is typed, and a stage
    that `splitrl run` started would show a command the user never typed."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def fail(exc: BaseException) -> NoReturn:
    """Say what went wrong in one line and exit 1."""
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def run_cli(what: Callable[[], Any]) -> Any:
    """Run ``what``: bad options or settings (`SettingsError`) are a usage error (exit 2); a failure while
    running (a link or peer failure, a bad value, a full disk) is one line and exit 1; Ctrl-C / SIGTERM
    exit 130. Anything else is a bug and keeps its traceback. A stage that `splitrl run` supervises
    (`SUPERVISED_ENV`) and that stops because its peer aborted says nothing: the peer has said why, on the
    same terminal."""
    # Imported here, not at the top: the transport pulls in torch, which `splitrl netem` does not need.
    from ..transport import PeerAbort, ProtocolError

    try:
        return what()
    except SettingsError as exc:
        raise OptionError(str(exc)) from None
    except PeerAbort as exc:
        if os.environ.get(SUPERVISED_ENV):
            sys.exit(1)
        fail(exc)
    except (ProtocolError, ValueError, RuntimeError, OSError, TimeoutError, ImportError) as exc:
        # ProtocolError, PeerAbort, TransportTimeout, CheckpointError... and ConnectionError are among these.
        fail(exc)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
