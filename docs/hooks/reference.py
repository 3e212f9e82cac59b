"""mkdocs hook: the reference that is generated at build time, never written twice.

- ``reference/cli.md`` is made here from the click commands: ``splitrl --help`` and, for every command and
  subcommand, its usage, its description and each option's help as ``--help`` prints it. The training options'
  help is each settings field's doc (``splitrl/settings``, turned into click options by ``splitrl/cli/options.py``),
  so changing a field's doc changes this page.
- In ``reference/metrics.md`` the marker ``<!-- generated: message kinds -->`` becomes the list of message kinds
  the stages send (``splitrl.stages.protocol.KINDS`` and the handshake's own), the ``KIND`` of the
  ``net/KIND/...`` keys.

mkdocs loads this file by path (``hooks:`` in mkdocs.yml); it puts the repository root first on ``sys.path`` so
that the splitrl documented is the one in this checkout.
"""

from __future__ import annotations

import html
import inspect
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["on_config", "on_files", "on_page_markdown", "cli_markdown", "CLI_PAGE", "KINDS_MARKER"]

CLI_PAGE = "reference/cli.md"
KINDS_MARKER = "<!-- generated: message kinds -->"

_SPECIAL = re.compile(r"([\\*_\[\]|`])")
"""What markdown would read as markup in plain text; ``<``, ``>`` and ``&`` become entities instead."""


def on_config(config: Any) -> Any:
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, CLI_PAGE, content=cli_markdown()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if KINDS_MARKER in markdown:
        markdown = markdown.replace(KINDS_MARKER, _kinds_markdown())
    return markdown


def _text(text: str) -> str:
    """Plain text for markdown: the parts outside backticks escaped (``<kind>`` is not a tag, ``*`` not
    emphasis, ``|`` not a table's cell), code spans kept as code."""
    def plain(part: str) -> str:
        return _SPECIAL.sub(r"\\\1", html.escape(part, quote=False))

    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: all of it plain
        return plain(text)
    return "".join(f"`{part}`" if i % 2 else plain(part) for i, part in enumerate(parts))


def _description(help_text: str | None) -> list[str]:
    """A command's docstring as click shows it: dedented, cut at ``\\f``, a ``\\b`` paragraph kept as written."""
    if not help_text:
        return []
    text = inspect.cleandoc(help_text).split("\f")[0]
    out = []
    for p in re.split(r"\n\s*\n", text):
        if p.startswith("\b\n"):  # click prints such a paragraph as written: so does the page
            out.append("```\n" + p[2:].rstrip() + "\n```")
        elif p.strip():
            out.append(_text(" ".join(p.replace("\b", "").split())))
    return out


def _anchor(path: list[str]) -> str:
    return "-".join(path)


def _settings_groups() -> list[tuple[str, str, list[str]]]:
    """(title, what it is, the click parameter names of its fields) of every settings dataclass with options."""
    import dataclasses

    from splitrl.settings import (CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings,
                                  TrainSettings)

    groups = []
    for title, cls in (("Training", TrainSettings), ("Environment", EnvSettings), ("PPO", PPOSettings),
                       ("Codecs", CodecSettings), ("Schedule", ScheduleSettings), ("Run options", RunOptions)):
        names = [f.name for f in dataclasses.fields(cls) if "help" in f.metadata]
        groups.append((title, " ".join((cls.__doc__ or "").split()), names))
    return groups


def _walk(cmd: Any, path: list[str], parent: Any) -> list[tuple[Any, list[str], Any]]:
    """Every command under ``cmd`` (itself first) with its path and click context, in the order shown."""
    import click

    ctx = click.Context(cmd, info_name=path[-1], parent=parent, **cmd.context_settings)
    out = [(cmd, path, ctx)]
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None:
                out += _walk(sub, [*path, name], ctx)
    return out


def _records(cmd: Any, ctx: Any) -> dict[str, tuple[str, str]]:
    """Each shown option of ``cmd`` by parameter name: (its declaration, its help as --help prints it)."""
    import click

    out = {}
    help_option = cmd.get_help_option(ctx)
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
        if record is not None and param is not help_option:  # every command takes -h / --help
            out[param.name] = (record[0], " ".join(record[1].split()))
    return out


def _table(records: list[tuple[str, str]]) -> list[str]:
    rows = [f"| `{decl}` | {_text(help_text)} |" for decl, help_text in records]
    return ["| option | what it does |", "|---|---|", *rows, ""] if rows else []


def _command(cmd: Any, path: list[str], ctx: Any, shared: dict[str, tuple[str, str]],
             groups: list[tuple[str, str, list[str]]]) -> list[str]:
    import click

    out = []
    if len(path) > 1:  # the page's title is the root's; a command is a section, a subcommand one below it
        out += [f"{'#' * len(path)} `{' '.join(path)}` {{ #{_anchor(path)} }}", ""]
    out += ["```", " ".join([*path, *cmd.collect_usage_pieces(ctx)]), "```", ""]
    for paragraph in [*_description(cmd.help), *_description(cmd.epilog or "")]:
        out += [paragraph, ""]
    arguments = [p for p in cmd.get_params(ctx) if isinstance(p, click.Argument)]
    if arguments:
        out += ["Arguments: " + ", ".join(f"`{p.human_readable_name}`" for p in arguments), ""]
    records = _records(cmd, ctx)
    same = {name for name, record in records.items() if shared.get(name) == record}
    claimed = [(title, names) for title, _, names in groups  # a group listed once below, if most of it is here
               if 2 * sum(n in same for n in names) > len(names)]
    elided = {n for _, names in claimed for n in names if n in same}
    out += _table([record for name, record in records.items() if name not in elided])
    taken = []
    for title, names in claimed:
        missing = [shared[n][0].split(",")[0].split(" ")[0] for n in names if n not in elided and n in shared]
        taken.append(f"[{title}](#{_slug(title)})" + (f" (not {', '.join(f'`{m}`' for m in missing)})"
                                                      if missing else ""))
    if taken:
        out += ["And the settings options (listed once, below) of: " + ", ".join(taken) + ".", ""]
    if isinstance(cmd, click.Group):
        out += ["Commands:", ""]
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None:
                out.append(f"- [`{' '.join([*path, name])}`](#{_anchor([*path, name])}): "
                           f"{_text(sub.get_short_help_str(limit=200))}")
        out.append("")
    return out


def _slug(title: str) -> str:
    return "options-" + title.lower().replace(" ", "-")


def cli_markdown() -> str:
    """The command-line reference page: every command of ``splitrl``, from the click commands themselves."""
    from splitrl.cli import main

    commands = _walk(main, ["splitrl"], None)
    groups = _settings_groups()
    settings_names = {name for _, _, names in groups for name in names}
    # each settings option as the commands built from the settings show it: those that take the most of them
    # (`run`, the stages); a command with an option of the same name but its own help or default lists it itself
    records = [{n: r for n, r in _records(cmd, ctx).items() if n in settings_names} for cmd, _, ctx in commands]
    shared = max(records, key=len)
    out = ["# Command-line reference", "",
           "Generated from the click commands when the site is built. The training commands' options are "
           "generated from the settings dataclasses (`splitrl/settings/`), each option's help being its field's "
           "doc, so this page and `splitrl COMMAND --help` say the same. Those options are listed once, at the "
           "end, grouped by the settings they belong to. Every command also takes `-h, --help`.", ""]
    for cmd, path, ctx in commands:
        out += _command(cmd, path, ctx, shared, groups)
    out += ["## Settings options { #settings-options }", "",
            "The training settings (every group but the run options) are what both stages must agree on: the "
            "handshake compares a hash of them. The run options are each process's own.", ""]
    for title, doc, names in groups:
        out += [f"### {title} {{ #{_slug(title)} }}", "", _text(doc), ""]
        out += _table([shared[n] for n in names if n in shared])
    return "\n".join(out) + "\n"


def _kinds_markdown() -> str:
    from splitrl.stages.protocol import KINDS
    from splitrl.transport.wire import ABORT_KIND, HELLO_KIND

    kinds = sorted(KINDS | {HELLO_KIND, ABORT_KIND})
    return ", ".join(f"`{kind}`" for kind in kinds)
