"""The two kinds of failure a command reports: a usage error (exit 2) and everything else (exit 1).

Kept at the bottom of the package so every layer can raise it.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["SettingsError"]


class SettingsError(ValueError):
    """The options or settings cannot be used: a wrong env id, a bad value, a run directory that
    holds another run. A usage error (exit 2) at the command line.

    Every other error raised while a command runs is a runtime failure (exit 1)."""

    HEAD = "invalid settings:\n  - "

    @classmethod
    def of(cls, problems: Sequence[str]) -> "SettingsError":
        """One problem in one line; several, one a line under `HEAD`."""
        return cls(problems[0] if len(problems) == 1 else cls.HEAD + "\n  - ".join(problems))

    def problems(self) -> list[str]:
        """The problems this error lists, one a line."""
        return str(self).removeprefix(self.HEAD).split("\n  - ")
