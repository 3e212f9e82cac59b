"""Click options generated from the settings dataclasses: one option per field, its doc line as the help."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import click
from click.core import ParameterSource

from ..runs import saved_config
from ..settings import (CODEC_STREAMS, CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings,
                        SettingsError, TrainSettings, option_name, resumed)
from .config import config_option
from .errors import OptionError

__all__ = ["training_options", "stage_argv"]

_SECTIONS: tuple[tuple[str | None, type], ...] = (
    (None, TrainSettings), ("env", EnvSettings), ("ppo", PPOSettings), ("codecs", CodecSettings),
    ("schedule", ScheduleSettings),
)


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if f.name.startswith("codec_"):
        stream = f.name.removeprefix("codec_")
        text += (f"; one of {', '.join(CODEC_STREAMS[stream])}, optionally NAME:key=value,... and +zstd "
                 "(details: splitrl codecs)")
    return text


def _click_options(cls: type, link: bool = True) -> list[Callable]:
    """One option per documented field (``link=False``: not the link's, which the twin does not take)."""
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or (f.metadata.get("link") and not link):
            continue  # nested sections get their own options
        name = option_name(f)
        # "T | None": an option that may stay unset (its default depends on the env: `EnvSettings.for_observation`)
        base = f.type.removesuffix(" | None") if isinstance(f.type, str) else f.type.__name__
        if base == "bool":
            decl = f"{name}/--no-{name[2:]}"
            out.append(click.option(decl, f.name, default=f.default, show_default=True, help=_help(f)))
        else:
            kind: Any = {"int": int, "float": float, "str": str}.get(base, str)
            if "choices" in f.metadata:
                kind = click.Choice(f.metadata["choices"])
            out.append(click.option(name, f.name, type=kind, default=f.default, show_default=True, help=_help(f)))
    return out


_RESUME_ROLES = {"stage0": "stage0", "stage1": "stage1", "train": "twin"}
"""Whose config a resumed command goes on with (`splitrl.runs.CONFIG_NAMES`); any other (``run``, ``lab``):
stage1's, in the run directory of the pair and of a fleet alike."""


def _given(kwargs: dict[str, Any]) -> set[str]:
    """The parameters given on the command line or in a --config file (not left at their defaults)."""
    ctx = click.get_current_context()
    return {name for name in kwargs if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)}


def _resumed(settings: TrainSettings, options: RunOptions, given: set[str]) -> tuple[TrainSettings, RunOptions]:
    """With --resume, the settings and options of the run in that directory (`splitrl.settings.resume`)."""
    if not options.resume:
        return settings, options
    role = _RESUME_ROLES.get(click.get_current_context().command.name or "", "stage1")
    try:
        return resumed(settings, options, given, saved_config(options.resume, role))
    except SettingsError as exc:
        raise OptionError(str(exc)) from None


def training_options(func: Callable | None = None, *, link: bool = True) -> Callable:
    """Add one click option per settings field and ``--config FILE``, and pass built settings objects instead
    (with ``--resume``, the run's: `splitrl.settings.resume`). ``link=False`` leaves out the options of the link
    between two processes (`splitrl train`, the twin, has none)."""
    if func is None:
        return functools.partial(training_options, link=link)
    options = ([opt for _, cls in _SECTIONS for opt in _click_options(cls)] + _click_options(RunOptions, link)
               + [config_option()])

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        given = _given(kwargs)

        def take(cls: type) -> Any:
            return cls(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls)
                          if "help" in f.metadata and f.name in kwargs})

        env, ppo, codecs, schedule = take(EnvSettings), take(PPOSettings), take(CodecSettings), take(ScheduleSettings)
        top = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(TrainSettings) if "help" in f.metadata}
        settings = TrainSettings(env=env, ppo=ppo, codecs=codecs, schedule=schedule, **top)
        settings, run_options = _resumed(settings, take(RunOptions), given)
        return func(settings=settings, options=run_options, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def stage_argv(settings: TrainSettings, options: RunOptions, *, absolute: bool = False) -> tuple[list[str], str]:
    """Check the settings (`ValueError` listing every problem), give the run its directory (a new one under
    runs/ unless --run-dir), and return (the argv both stage processes get, the run directory)."""
    devices = options.device_errors("stage0", "stage1")  # both stages run on this machine
    try:
        settings.validate(options)
    except SettingsError as exc:  # every problem at once, the devices' too
        raise SettingsError("\n  - ".join([str(exc), *devices])) from None
    if devices:
        raise SettingsError(SettingsError.HEAD + "\n  - ".join(devices))
    run_dir = options.run_dir_for(settings.env.env_id)
    if absolute:
        run_dir = os.path.abspath(run_dir)
    resume = run_dir if options.resume else ""
    return settings.to_argv() + dataclasses.replace(options, run_dir=run_dir, resume=resume).to_argv(), run_dir
