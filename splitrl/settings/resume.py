"""What a resumed run takes from its directory: every training setting as the run saved it. Only
``--total-steps`` (`LENGTH`) and the run-time options (`RUNTIME`) may be given again with another value; any
other option given must say what the run already has.

`resumed` reads the config a process wrote at the run's start (`splitrl.runs.saved_config`) against the
options given on the command line (or in a ``--config`` file): an option not given is the run's, so
``--resume DIR`` alone continues the run as it was started.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from ..errors import SettingsError
from .options import option_name
from .sections import RunOptions, TrainSettings

__all__ = ["RUNTIME", "LENGTH", "WHERE", "resumed"]

RUNTIME = ("timeout", "start_timeout", "heartbeat", "rejoin", "min_edges", "threads", "part_workers", "channels_last",
           "stage0_device", "stage1_device", "vector", "transport", "curve", "curve_name", "insecure", "checkpoint_every",
           "keep_checkpoints", "tensorboard", "track", "wandb_project_name", "wandb_entity", "capture_video",
           "video_every")
"""The options a resumed run may be given with other values than it ran with: they say how this process runs on this
machine, not what the run computes or records. Liveness (how long to wait for the peer, how a lost one is noticed
and waited for, how many edges a fleet trains on with when one fails), the machine (torch's threads, the
micro-batches' workers, the convolutions' memory layout, each stage's device, whether the envs step in worker
processes), the link (its transport and keys: the same frames cross either way), and housekeeping (how often
checkpoints are written and how many are kept, TensorBoard files beside metrics.jsonl, logging to Weights & Biases,
videos of the evaluations). A stage moved to another device, thread count or layout computes the same maths, though
not always to the last bit. Every other option is fixed by the run: the training settings (`TrainSettings`) and the
options that change what it computes or records (``--eval-every``, ``--eval-episodes``, ``--act-wait``,
``--learners``, ``--edge-id``)."""

LENGTH = ("total_steps",)
"""Training settings that a resumed run may change: how long it goes on."""

WHERE = ("run_dir", "resume", "overwrite")
"""The options that say where the run is and whether it goes on: ``--resume`` itself sets them."""


def _flat(settings: TrainSettings) -> dict[str, tuple[str | None, Any]]:
    """field name -> (its section or None, its value), over ``settings`` and its sections (click's flat option
    names: a field's name is unique across them)."""
    out: dict[str, tuple[str | None, Any]] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            out.update({g.name: (f.name, getattr(value, g.name)) for g in dataclasses.fields(value)})
        else:
            out[f.name] = (None, value)
    return out


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    out = {}
    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            out.update(_fields(f.default_factory))
        else:
            out[f.name] = f
    return out


def _spelled(f: dataclasses.Field, value: Any) -> str:
    """How ``value`` of the field ``f`` is written on the command line."""
    name = option_name(f)
    if isinstance(value, bool):
        return name if value else f"--no-{name[2:]}"
    return f"{name} {value}"


def resumed(settings: TrainSettings, options: RunOptions, given: Iterable[str],
            saved: dict[str, Any]) -> tuple[TrainSettings, RunOptions]:
    """``settings`` and ``options`` as the run in ``options.resume`` goes on with them. ``given``: the fields
    given on the command line or in a config file (by field name); ``saved``: the config its process wrote at the
    start (``settings``, ``options`` and the observations' kind in ``env_spec``). A field not given is the run's;
    a given one must be the run's too (``--model auto`` and the image options' unset defaults compare as what
    they became for the run's observations), but for `LENGTH` and `RUNTIME`. SettingsError naming every option
    given with another value, in one line."""
    given = set(given)
    kind = saved.get("env_spec", {}).get("observation", "image")
    run = _flat(TrainSettings.from_dict(saved["settings"]).for_observation(kind))
    now, typed = _flat(settings.for_observation(kind)), _flat(settings)
    fields = _fields(TrainSettings)
    differ: list[str] = []
    sections: dict[str | None, dict[str, Any]] = {}
    for name, (section, value) in run.items():
        if name in given and name in LENGTH:
            value = typed[name][1]
        elif name in given and now[name][1] != value:
            differ.append(f"{_spelled(fields[name], typed[name][1])} (the run has {_spelled(fields[name], value)})")
        sections.setdefault(section, {})[name] = value
    merged = TrainSettings(**sections.pop(None), **{s: type(getattr(settings, s))(**v) for s, v in sections.items()})
    ran = saved.get("options", {})
    chosen = {}
    for f in dataclasses.fields(RunOptions):
        value = getattr(options, f.name)
        if f.name in WHERE or f.name not in ran:  # a run from before the option was: it ran with the default
            if f.name not in WHERE and f.name in given and f.name not in RUNTIME and value != f.default:
                differ.append(f"{_spelled(f, value)} (the run has {_spelled(f, f.default)})")
        elif f.name not in given:
            value = ran[f.name]
        elif f.name not in RUNTIME and value != ran[f.name]:
            differ.append(f"{_spelled(f, value)} (the run has {_spelled(f, ran[f.name])})")
        chosen[f.name] = value
    if differ:
        runtime = ", ".join(option_name(f) for f in dataclasses.fields(RunOptions) if f.name in RUNTIME)
        raise SettingsError(f"--resume {options.resume} goes on with the run's own settings: {'; '.join(differ)}; "
                            f"only --total-steps and the run-time options ({runtime}) may change")
    return merged, RunOptions(**chosen)
