"""A run's directory: checked and prepared before any socket opens, and where a resumed run goes on from.

`prepare` refuses a directory that holds a run already, unless the run resumes (its settings must be
this run's, but for ``total_steps``) or overwrites it; `check` is everything it checks, with nothing written
(``splitrl run`` calls it before it starts a stage). `resume_point` is the newest iteration both stages
hold a checkpoint of; `recorded_checkpoints` says which of stage0's count.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from ..devices import describe_device, resolve_device, use_device
from ..envs import EnvSpec, inspect_env
from ..models import agent
from ..runs import CONFIG_NAMES, RunLog, intact_checkpoints, read_metrics, saved_config
from ..schedule import workers
from ..settings import RunOptions, SettingsError, TrainSettings
from ..settings.specs import AUTO_MODEL, AUTO_MODELS
from ..stages import STAGE0, STAGE1
from ..transport import ProtocolError
from ..transport.errors import peer_repr
from ..transport.handshake import HandshakeError
from .precheck import run_dir_problem, setting_problems
from .tracking import WandbTracker

__all__ = ["prepare", "check", "resume_point", "recorded_checkpoints"]

log = logging.getLogger(__name__)


def prepare(settings: TrainSettings, options: RunOptions, role: str) -> tuple[TrainSettings, EnvSpec, RunLog]:
    """Check everything before any socket opens; set threads; write the config file. Returns the settings as they
    run (``--model auto`` and the image options resolved for the env's observations: what the config records and
    the handshake compares, so that a stage given ``--model nature`` and one left at ``auto`` agree), the env's
    spec and the run's log.

    A run directory that holds a run already is refused, unless ``--resume`` (its settings must be
    this run's, but for ``total_steps``) or ``--overwrite`` (its metrics, episodes and checkpoints go)."""
    if options.threads > 0:  # first: the network built to check the settings inits on as many threads as the run's
        torch.set_num_threads(options.threads)
    workers.configure(options.part_workers)
    settings, spec, run_dir = check(settings, options, role)
    devices = {stage: resolve_device(options.device(stage)) for stage in _stages(role)}
    for device in devices.values():
        use_device(device)
    if options.overwrite:
        _clear(Path(run_dir))
    config_name = CONFIG_NAMES[role]
    # stage0 writes the metrics (stage1's keys ride on them), so TensorBoard is stage0's, or the twin's.
    run_log = RunLog(run_dir, keep=options.keep_checkpoints, tensorboard=options.tensorboard and role != STAGE1)
    config: dict[str, Any] = {
        "settings": settings.to_dict(),
        "options": dataclasses.asdict(options),
        "env_spec": dataclasses.asdict(spec),
        "torch_threads": torch.get_num_threads(),
        "devices": {stage: describe_device(device) for stage, device in devices.items()},
    }
    run_log.write_config(config, config_name)
    if options.track and role != STAGE1:  # the metrics' process, as TensorBoard's
        run_log.tracker = WandbTracker(settings, options, run_dir, config)
    return settings, spec, run_log


LAUNCHER = "run"
"""`check`'s role for ``splitrl run``: it checks what both stages will (their devices, stage1's run directory)
before it starts them."""


def _stages(role: str) -> tuple[str, ...]:
    """The stages a process of ``role`` runs (or checks for): its own, or both (the twin, the launcher)."""
    return (STAGE0, STAGE1) if role in ("twin", LAUNCHER) else (role,)


def check(settings: TrainSettings, options: RunOptions, role: str) -> tuple[TrainSettings, EnvSpec, str]:
    """Everything `prepare` checks, with nothing written: the options' own ranges and rules, the device of each
    stage ``role`` runs, the env, then the model, its kwargs and the cut, which need the env's shapes, and the run
    directory (one to write, a fresh one unless --overwrite, a resumed one whose settings are these). Every
    problem in one SettingsError. Returns the settings as they run (`TrainSettings.for_observation`), the env's
    spec and the run directory."""
    problems = setting_problems(settings, options)
    # A stage process is told its device with --device (or --ROLE-device); the twin, with both --ROLE-device.
    problems += options.device_errors(*_stages(role), option=None if role in ("twin", LAUNCHER) else "--device")
    spec = None
    try:
        spec = inspect_env(settings.env)
    except SettingsError as exc:
        problems.append(str(exc))
    if spec is not None:
        try:
            agent(settings, spec)
        except SettingsError as exc:
            problems.append(str(exc))
        except Exception:
            if not problems:
                raise
            # an invalid setting above is why the network could not be built
    run_dir = options.run_dir_for(settings.env.env_id)
    stage = STAGE1 if role == LAUNCHER else role
    problem = run_dir_problem(settings, options, stage)
    if problem is None and options.resume and spec is not None:
        try:
            _check_resumable(run_dir, stage, settings.for_observation(spec.observation))
        except SettingsError as exc:
            problem = str(exc)
    if problem is not None:
        problems.append(problem)
    if problems:
        raise SettingsError.of(problems)
    assert spec is not None  # an env that could not be inspected is among the problems
    if settings.model == AUTO_MODEL and role != LAUNCHER:
        log.info("[%s] model: %s (--model %s, for %s observations)", role, AUTO_MODELS[spec.observation],
                 AUTO_MODEL, spec.observation)
    return settings.for_observation(spec.observation), spec, run_dir


def _check_resumable(run_dir: str, role: str, settings: TrainSettings) -> None:
    """SettingsError unless the run in ``run_dir`` saved a config of ``role`` whose settings are ``settings``, but
    for ``total_steps``."""
    config = saved_config(run_dir, role)
    # A run made before a setting existed ran with its default: it reads back as such.
    kind = config.get("env_spec", {}).get("observation", "image")
    saved = _flatten(TrainSettings.from_dict(config["settings"]).for_observation(kind).to_dict())
    now = _flatten(settings.to_dict())
    differ = [f"{key}: the run has {saved.get(key)!r}, now {now.get(key)!r}" for key in sorted(set(saved) | set(now))
              if key != "total_steps" and saved.get(key) != now.get(key)]
    if differ:
        raise SettingsError(f"--resume {run_dir}: the settings differ from the run's (only --total-steps may): "
                         + "; ".join(differ))


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _clear(run_dir: Path) -> None:
    for name in ("metrics.jsonl", "episodes.jsonl"):
        (run_dir / name).unlink(missing_ok=True)
    if (run_dir / "checkpoints").is_dir():
        shutil.rmtree(run_dir / "checkpoints")


def resume_point(peer_hello: dict[str, Any], ours: list[int]) -> int:
    """The newest iteration both stages have a checkpoint of (0: none)."""
    theirs = peer_hello.get("checkpoints")
    if theirs is None:
        raise HandshakeError("the peer does not resume: this side continues a run (--resume, or a rejoin after "
                             "the peer was lost), so start the peer with --resume RUN_DIR too")
    if not isinstance(theirs, list) or not all(isinstance(i, int) for i in theirs):
        raise ProtocolError("hello: expected the peer's checkpoint iterations as a list of ints, got "
                            f"{peer_repr(theirs)}")
    return max(set(ours) & set(theirs), default=0)


def recorded_checkpoints(run_dir: Path) -> list[int]:
    """Stage0's intact checkpoints (`intact_checkpoints`) whose iteration has its metrics record: the checkpoint
    is written before the record (the record needs stage1's statistics, which come with the end of the
    iteration), so a run stopped between the two resumes from the checkpoint before, and redoes that iteration,
    rather than leave a hole in metrics.jsonl."""
    try:
        recorded = {int(r["iteration"]) for r in read_metrics(run_dir)}
    except ValueError:  # no metrics.jsonl: no iteration was recorded
        recorded = set()
    return [i for i in intact_checkpoints(run_dir, STAGE0) if i in recorded]
