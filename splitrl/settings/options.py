"""The option machinery: a settings field declared once with its default, its one-line doc and the values it
may take, and one routine that checks every declared field.

A field's metadata holds ``help`` (its doc: the click option's help, splitrl/cli/options.py), ``option`` (its
option's name if not the field's), ``link`` (an option of the link between two processes), and what it may
take: ``choices``, ``nonempty``, ``min`` / ``max`` (inclusive), ``above`` (exclusive lower bound), ``finite``,
``note`` (what a bound's edge means, e.g. "0: none") and ``spec`` (a parser that raises ValueError naming
what is wrong). `field_errors` reads them all; rules that tie several options together are `rules.RULES`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, Callable, Mapping

__all__ = ["doc", "option_name", "field_errors", "bound_error", "BOUNDS", "to_argv"]

BOUNDS = ("min", "max", "above")
"""The metadata keys of a numeric field's range."""


def doc(default: Any, help: str, option: str | None = None, *, choices: tuple[str, ...] | None = None,
        link: bool = False, min: float | None = None, max: float | None = None, above: float | None = None,
        finite: bool = False, note: str | None = None, nonempty: bool = False,
        spec: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field with a default and a one-line help text; its option's name if not the field's, the
    values it may take (``choices``; ``min``/``max`` inclusive, ``above`` exclusive, ``finite``; ``nonempty``;
    ``spec``: a parser raising ValueError), ``note``: what a bound's edge means, and ``link``: an option of the
    link between two processes, which the single-process twin does not take."""
    meta: dict[str, Any] = {"help": help}
    extra = {"option": option, "choices": choices, "min": min, "max": max, "above": above, "note": note,
             "spec": spec}
    meta.update({key: value for key, value in extra.items() if value is not None})
    meta.update({key: True for key, flag in (("link", link), ("finite", finite), ("nonempty", nonempty)) if flag})
    return field(default=default, metadata=meta)


def option_name(f: dataclasses.Field) -> str:
    """The command-line option of a settings field: ``--field-name`` unless the field names another."""
    return "--" + f.metadata.get("option", f.name.replace("_", "-"))


def bound_error(label: str, value: float, meta: Mapping[str, Any]) -> str | None:
    """The message if ``value`` lies outside the range ``meta`` declares (NaN always does), else None."""
    low, high, above = meta.get("min"), meta.get("max"), meta.get("above")
    if low is None and high is None and above is None:
        return None
    inside = ((low is None or value >= low) and (high is None or value <= high)
              and (above is None or value > above) and not (meta.get("finite") and not math.isfinite(value))
              and value == value)
    if inside:
        return None
    note = f" ({meta['note']})" if meta.get("note") else ""
    if low is not None and high is not None:
        want = f"in [{low:g}, {high:g}]"
    elif above is not None:
        want = f"> {above:g}"
    elif low is not None:
        want = f">= {low:g}"
    else:
        want = f"<= {high:g}"
    return f"{label} must be {want}{note}, got {value}"


def _errors_of(f: dataclasses.Field, value: Any) -> list[str]:
    meta, name = f.metadata, option_name(f)
    if "choices" in meta and value not in meta["choices"]:
        return [f"{name} must be one of {', '.join(meta['choices'])}, got {value!r}"]
    if meta.get("nonempty") and not value:
        return [f"{name} must not be empty"]
    out = []
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        message = bound_error(name, value, meta)
        out += [message] if message else []
    if "spec" in meta:
        try:
            meta["spec"](value)
        except ValueError as exc:
            out.append(str(exc))
    return out


def field_errors(settings: Any) -> list[str]:
    """Every declared field of a settings dataclass (nested sections included) checked against what it may
    take; one message a field that may not take its value."""
    out: list[str] = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        out += field_errors(value) if dataclasses.is_dataclass(value) else _errors_of(f, value)
    return out


def to_argv(settings: Any) -> list[str]:
    """Command-line options for every documented field of a settings dataclass, nested sections included."""
    args: list[str] = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            args += to_argv(value)
            continue
        name = option_name(f)
        if value is None:  # unset: the process that reads these options leaves it unset too
            continue
        if isinstance(value, bool):
            args.append(name if value else f"--no-{name[2:]}")
        else:
            args += [name, repr(value) if isinstance(value, float) else str(value)]
    return args
