"""``--config FILE``: option values from a TOML file (or YAML, where PyYAML is installed), below the command line.

The file is flat: one key per option, named as on the command line without its dashes (``num-envs = 8``;
``num_envs`` is the same key; a flag is ``true`` or ``false``, e.g. ``async = true``). Its values become the
command's defaults (click's ``default_map``), so an option given on the command line wins, and a value from
the file counts as given (``--resume`` compares it with the run's, as it does the command line's). A key that
is no option of the command is an error naming it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import click

from .errors import OptionError

__all__ = ["config_option", "read_config"]

_NOT_OPTIONS = ("config", "help", "version")


def _keys(command: click.Command) -> dict[str, str]:
    """Every key a config file may use for ``command`` -> the parameter it sets."""
    out: dict[str, str] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in _NOT_OPTIONS or param.name is None:
            continue
        for spelling in (param.name, *(opt.lstrip("-") for opt in param.opts if opt.startswith("--"))):
            out[spelling] = out[spelling.replace("_", "-")] = out[spelling.replace("-", "_")] = param.name
    return out


def _load(path: Path) -> Any:
    """The file's contents: TOML, or YAML for a .yaml / .yml file."""
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise OptionError(f"--config {path}: reading YAML needs PyYAML (pip install 'splitrl[yaml]'); a TOML "
                              "file needs nothing more") from None
        try:
            return yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise OptionError(f"--config {path}: {' '.join(str(exc).split())}") from None
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise OptionError(f"--config {path}: {exc}") from None


def read_config(path: str | Path, command: click.Command) -> dict[str, Any]:
    """The option values of the config file ``path`` for ``command``, keyed by parameter name (click's
    ``default_map``); OptionError naming the file and what is wrong (a key that is no option of ``command``,
    a value that is not a number, a string or true/false)."""
    path = Path(path)
    data = _load(path)
    if not isinstance(data, dict):
        raise OptionError(f"--config {path}: expected option = value lines, got {type(data).__name__}")
    keys = _keys(command)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = keys.get(str(key))
        if name is None:
            raise OptionError(f"--config {path}: unknown key {key!r}: not an option of `splitrl {command.name}`")
        if not isinstance(value, (str, int, float, bool)):
            raise OptionError(f"--config {path}: {key} must be a number, a string or true/false, got "
                              f"{type(value).__name__}")
        if name in out:
            raise OptionError(f"--config {path}: {key} sets an option set already")
        out[name] = value
    return out


def _apply(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.default_map = {**(ctx.default_map or {}), **read_config(value, ctx.command)}


def config_option() -> Any:
    """The ``--config FILE`` option: read first (eager), its values the defaults of the command's other options."""
    return click.option("--config", type=click.Path(exists=True, dir_okay=False), is_eager=True,
                        expose_value=False, callback=_apply,
                        help="a TOML file of option values, one 'option = value' a line without the dashes (e.g. "
                             "num-envs = 8, async = true; also YAML as .yaml/.yml where PyYAML is installed); the "
                             "command line wins over it")
