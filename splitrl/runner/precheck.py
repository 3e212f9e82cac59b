"""The checks of `rundir.check` that need neither torch nor an env built: the env id among gymnasium's registered
ones, and the run directory (writable, fresh unless --overwrite, a resumed one's saved config there). `splitrl run`
makes them before it imports torch, so that these mistakes are told in well under a second; the whole check (the
settings' values and rules, which parse the codecs with torch, the devices, the env made, the network built)
follows when they pass."""

from __future__ import annotations

import gymnasium as gym
from gymnasium.envs.registration import _find_spec

from .. import envs  # noqa: F401  (registers splitrl's own envs, as making one would)
from ..runs import CONFIG_NAMES, check_fresh, check_run_dir, saved_config
from ..settings import EnvSettings, RunOptions, SettingsError, TrainSettings


def first_problems(settings: TrainSettings, options: RunOptions, stage: str) -> list[str]:
    """What of ``settings`` and ``options`` is wrong on its face, one line a problem (none: the whole check
    follows); ``stage``: the process whose saved config a resumed run reads (`splitrl.runs.CONFIG_NAMES`)."""
    problems = (env_id_problem(settings.env), run_dir_problem(settings, options, stage))
    return [problem for problem in problems if problem is not None]


def setting_problems(settings: TrainSettings, options: RunOptions) -> list[str]:
    """The options' own ranges and the rules between them (`TrainSettings.validate`)."""
    try:
        settings.validate(options)
    except SettingsError as exc:
        return exc.problems()
    return []


def env_id_problem(env: EnvSettings) -> str | None:
    """The env id names no env gymnasium can make: looked up as `gymnasium.make` looks it up (a ``module:`` prefix
    imported, no version the newest), without making it (the whole check does, and checks the rest)."""
    try:
        _find_spec(env.env_id)
    except (gym.error.Error, ImportError) as exc:
        return f"--env-id {env.env_id!r}: {exc}"
    return None


def run_dir_problem(settings: TrainSettings, options: RunOptions, stage: str) -> str | None:
    """The run directory cannot take this run: not writable, another run's without --overwrite, or (--resume) no
    run of ``stage`` there to go on with."""
    assert stage in CONFIG_NAMES
    run_dir = options.run_dir_for(settings.env.env_id)
    try:
        check_run_dir(run_dir, "--resume" if options.resume else "--run-dir")
        if options.resume:
            saved_config(run_dir, stage)
        elif not options.overwrite:
            check_fresh(run_dir)
    except SettingsError as exc:
        return str(exc)
    return None
