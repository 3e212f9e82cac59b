"""The two kinds of failure a command reports: a usage error (exit 2) and everything else (exit 1).

Kept at the bottom of the package so every layer can raise it.
"""

from __future__ import annotations

__all__ = ["SettingsError"]


class SettingsError(ValueError):
    """The options or settings cannot be used: a wrong env id, a bad value, a run directory that
    holds another run. A usage error (exit 2) at the command line.

    Every other error raised while a command runs is a runtime failure (exit 1)."""
