"""Run directories: writing them (`RunLog`, checkpoints) and reading their files back (metrics, episodes, bytes
on the link).

A run directory holds config.json (config-stage0.json / config-stage1.json for
split runs), metrics.jsonl (one line per iteration), episodes.jsonl (one line
per finished episode) and checkpoints/.

Bytes on the link come from stage0's meters, which see both directions:
``net/<kind>/<direction>_bytes`` is what crossed during one iteration,
``net_total/<kind>/<direction>_bytes`` everything up to the end of it
(docs/PROTOCOL.md section 9). Every benchmark, report and curve reads them
through these readers (`link_bytes`, `iteration_bytes`, ...) and `splitrl.summary`
(a run, or a fleet's edges, read back whole and summarised).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

from .errors import SettingsError

__all__ = [
    "RunLog",
    "CheckpointError",
    "checkpoint_path",
    "checkpoint_iterations",
    "intact_checkpoints",
    "load_checkpoint",
    "upgrade_checkpoints",
    "truncate_logs",
    "check_fresh",
    "check_run_dir",
    "CONFIG_NAMES",
    "saved_config",
    "default_run_dir",
    "read_metrics",
    "read_episodes",
    "newest_evals",
    "run_settings",
    "link_bytes",
    "link_messages",
    "NOT_TRAINING_KINDS",
    "metric_scalars",
    "summary_writer",
    "iteration_bytes",
    "iteration_messages",
    "measured_records",
    "EMA_DECAY",
]

log = logging.getLogger(__name__)


def default_run_dir(env_id: str) -> str:
    return str(Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{env_id.replace('/', '_')}")


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write null so every line parses with a strict reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


TENSORBOARD_HINT = "install it with the report extra: pip install -c constraints.txt -e '.[report]' (make does)"


def summary_writer(log_dir: str | Path) -> Any:
    """PyTorch's TensorBoard `SummaryWriter` on ``log_dir``; ImportError saying how to install it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}") from None
    return SummaryWriter(log_dir=str(log_dir))


def metric_scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """A metrics record's numbers as TensorBoard scalars: every ``section/name`` key holding an int or float."""
    return [(k, v) for k, v in record.items()
            if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


class CheckpointError(OSError):
    """A checkpoint could not be written (the path and the reason are in the message); the older ones are intact."""


class RunLog:
    """One run directory: JSON-lines files appended to, checkpoints written atomically.

    A checkpoint ``checkpoints/<stage>-iterNNNNN.pt`` is written to a temporary file,
    flushed to disk and renamed into place, then its SHA-256 goes beside it
    (``.sha256``, written the same way): a checkpoint counts only once both are there
    and agree, so a stage killed or out of disk mid-write leaves the previous one as
    the newest. ``keep`` newest checkpoints per stage are kept (0: all).
    """

    def __init__(self, run_dir: str | Path, keep: int = 0, tensorboard: bool = False) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.board: Any = None
        """With ``tensorboard``, a `SummaryWriter` on ``tensorboard/`` in the run directory that gets every
        metrics record as it is written (and is flushed then, so TensorBoard shows a run while it trains)."""
        if tensorboard:
            self.board = summary_writer(self.dir / "tensorboard")
        self.tracker: Any = None
        """With ``--track``, what also gets every metrics record and episode line, and is closed with the log:
        an object with ``metrics(record)``, ``episode(record)`` and ``close()``
        (`splitrl.runner.tracking.WandbTracker`)."""

    def write_config(self, config: dict[str, Any], name: str = "config.json") -> None:
        (self.dir / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open(self.dir / name, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def metrics(self, record: dict[str, Any]) -> None:
        self._append("metrics.jsonl", record)
        if self.board is not None:
            for key, value in metric_scalars(record):
                self.board.add_scalar(key, value, record["global_step"])
            self.board.flush()
        if self.tracker is not None:
            self.tracker.metrics(record)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.close()

    def episode(self, record: dict[str, Any]) -> None:
        self._append("episodes.jsonl", record)
        if self.tracker is not None:
            self.tracker.episode(record)

    def checkpoint(self, stage: str, iteration: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as ``stage``'s checkpoint of ``iteration``; `CheckpointError` naming the path if it fails."""
        from .checkpoints import dumps  # reading a run directory needs no torch

        path = checkpoint_path(self.dir, stage, iteration)
        path.parent.mkdir(exist_ok=True)
        data = dumps(state)
        try:
            _write_atomically(path, data)
            _write_atomically(path.with_name(path.name + ".sha256"), hashlib.sha256(data).hexdigest().encode())
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}; the previous one is "
                                  f"intact") from None
        if self.keep:
            for old in checkpoint_iterations(self.dir, stage)[:-self.keep]:
                self._remove(stage, old)
        return path

    def drop_checkpoints_after(self, stage: str, iteration: int) -> None:
        """Remove ``stage``'s checkpoints of iterations after ``iteration`` (with their checksum files)."""
        for later in checkpoint_iterations(self.dir, stage):
            if later > iteration:
                self._remove(stage, later)

    def _remove(self, stage: str, iteration: int) -> None:
        path = checkpoint_path(self.dir, stage, iteration)
        for each in (path, path.with_suffix(".pt.sha256")):
            each.unlink(missing_ok=True)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def checkpoint_path(run_dir: str | Path, stage: str, iteration: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{stage}-iter{iteration:05d}.pt"


def checkpoint_iterations(run_dir: str | Path, stage: str) -> list[int]:
    """The iterations of ``stage``'s complete checkpoints (written whole, checksum beside), ascending.

    The checksum is compared when a checkpoint is loaded (`load_checkpoint`), not here."""
    found = []
    for path in (Path(run_dir) / "checkpoints").glob(f"{stage}-iter*.pt"):
        digits = path.stem.rpartition("-iter")[2]
        if digits.isdigit() and path.with_name(path.name + ".sha256").exists():
            found.append(int(digits))
    return sorted(found)


def intact_checkpoints(run_dir: str | Path, stage: str) -> list[int]:
    """`checkpoint_iterations` whose files match their checksums: where a run resumes from. A damaged one is
    passed over with a warning, so the run goes on from the newest intact checkpoint before it."""
    intact = []
    for iteration in checkpoint_iterations(run_dir, stage):
        path = checkpoint_path(run_dir, stage, iteration)
        try:
            _checked_bytes(path)
        except (OSError, ValueError) as exc:
            why = str(exc) if str(path) in str(exc) else f"checkpoint {path} cannot be read ({exc})"
            log.warning("%s; passed over: the run resumes from an older checkpoint if there is one", why)
        else:
            intact.append(iteration)
    return intact


def _checked_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    expected = path.with_name(path.name + ".sha256").read_text().strip()
    if hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"checkpoint {path} does not match its checksum: it is damaged")
    return data


def load_checkpoint(run_dir: str | Path, stage: str, iteration: int) -> dict[str, Any]:
    """``stage``'s checkpoint of ``iteration``, after checking its SHA-256 (ValueError if it does not match).

    Only tensors and plain values are read (`splitrl.checkpoints`): a file that names any other Python object
    is refused with `UnsafeCheckpointError`, whatever its checksum says, and nothing in it runs."""
    from .checkpoints import loads

    path = checkpoint_path(run_dir, stage, iteration)
    return loads(_checked_bytes(path), f"checkpoint {path}")


def upgrade_checkpoints(run_dir: str | Path) -> list[Path]:
    """Rewrite every checkpoint under ``run_dir`` (its edges' and learners' directories included) that is in the
    pickled format 1 (as those committed under docs/results are) in the current format
    (`splitrl.checkpoints.upgrade`), each after its checksum is checked and atomically with a new one; the paths
    rewritten. Those already current are left as they are."""
    from .checkpoints import upgrade

    done = []
    for path in sorted(Path(run_dir).glob("**/checkpoints/*-iter*.pt")):
        if not path.with_name(path.name + ".sha256").exists():
            continue
        data = upgrade(_checked_bytes(path), f"checkpoint {path}")
        if data is not None:
            _write_atomically(path, data)
            _write_atomically(path.with_name(path.name + ".sha256"), hashlib.sha256(data).hexdigest().encode())
            done.append(path)
    return done


def truncate_logs(run_dir: str | Path, iteration: int) -> None:
    """Drop metrics and episodes of iterations after ``iteration`` (a resumed run writes them again)."""
    for name in ("metrics.jsonl", "episodes.jsonl"):
        path = Path(run_dir) / name
        if path.exists():
            kept = [json.dumps(r) + "\n" for r in _read_jsonl(path) if r.get("iteration", 0) <= iteration]
            _write_atomically(path, "".join(kept).encode())


def check_fresh(run_dir: str | Path) -> None:
    """SettingsError if ``run_dir`` already holds a run: it would mix two runs' metrics and checkpoints."""
    path = Path(run_dir)
    if any((path / name).exists() for name in ("metrics.jsonl", "episodes.jsonl", "checkpoints")):
        raise SettingsError(f"--run-dir {run_dir} already holds a run: pass --resume {run_dir} to continue it, "
                         "--overwrite to start again in it, or another --run-dir")


def check_run_dir(run_dir: str | Path, option: str = "--run-dir") -> None:
    """SettingsError if no run could be written in ``run_dir``: it is a file, or the nearest folder above it that
    exists is a file or cannot be written to."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise SettingsError(f"{option} {run_dir} is a file, not a directory")
    above = path.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise SettingsError(f"{option} {run_dir}: {above} is a file, not a directory")
    if not path.exists() and not os.access(above, os.W_OK | os.X_OK):
        raise SettingsError(f"{option} {run_dir}: cannot create it ({above} is not writable)")


CONFIG_NAMES = {"twin": "config.json", "stage0": "config-stage0.json", "stage1": "config-stage1.json"}
"""The config file each kind of process writes into its run directory (the twin's, or each stage's)."""


def saved_config(run_dir: str | Path, role: str) -> dict[str, Any]:
    """The config the ``role`` process (`CONFIG_NAMES`) of the run in ``run_dir`` wrote at its start, which a
    resumed run goes on with; SettingsError naming ``--resume`` if the directory or the file is missing."""
    path = Path(run_dir)
    if not path.is_dir():
        raise SettingsError(f"--resume {run_dir}: " + ("not a directory" if path.exists() else "no such directory"))
    config = path / CONFIG_NAMES[role]
    if not config.is_file():
        raise SettingsError(f"--resume {run_dir}: no {config.name} there (not a run directory of "
                            f"{'the twin' if role == 'twin' else role}?)")
    try:
        saved = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"--resume {run_dir}: {config.name} cannot be read ({exc})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict):
        raise SettingsError(f"--resume {run_dir}: {config.name} holds no settings")
    return saved


# -- reading ---------------------------------------------------------------------------


def is_twin(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` is the twin's (both stages in one process: it wrote `CONFIG_NAMES` ``twin``'s file)."""
    return (Path(run_dir) / CONFIG_NAMES["twin"]).is_file()


def iteration_cpu(record: dict[str, Any], twin: bool) -> float:
    """The CPU seconds an iteration's record says its processes spent: both stages' and the env workers'
    (``cpu/envs``, 0 where the envs step in stage0). The twin's one process records its CPU as both stages'
    (`docs/reference/metrics.md`): counted once."""
    stage1 = 0.0 if twin else record["cpu/stage1"]
    return record["cpu/stage0"] + stage1 + record.get("cpu/envs", 0.0)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One record per non-empty line; a half-written last line (a run still writing it) is left out. A ``.gz``
    file is read through gzip (a long run's records kept compressed)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
    return records


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metrics records, one per iteration: metrics.jsonl, or metrics.jsonl.gz where a finished run's
    records were kept compressed (a committed record over 2 MB is)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists() and path.with_name("metrics.jsonl.gz").exists():
        path = path.with_name("metrics.jsonl.gz")
    if not path.exists():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a splitrl run directory?)")
    return _read_jsonl(path)


def read_episodes(run_dir: str | Path) -> list[dict[str, Any]]:
    """Finished episodes; none before the first one ends (episodes.jsonl is written then)."""
    path = Path(run_dir) / "episodes.jsonl"
    return _read_jsonl(path) if path.exists() else []


def newest_evals(run_dir: str | Path, iteration: int | None = None) -> dict[bool, dict[str, Any]]:
    """The newest line of the run's eval.jsonl (`splitrl eval`) of each mode, keyed by ``deterministic``: a
    deterministic and a sampled score are not the same measure and one never stands in for the other. Only the
    lines of ``iteration``'s checkpoints if given."""
    path = Path(run_dir) / "eval.jsonl"
    newest: dict[bool, dict[str, Any]] = {}
    for record in _read_jsonl(path) if path.exists() else []:
        if iteration is None or record.get("iteration") == iteration:
            newest[bool(record.get("deterministic"))] = record
    return newest


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's config file as written at its start (stage0's for a split run: config-stage0.json);
    `SettingsError` if there is none."""
    for name in ("config-stage0.json", "config.json"):
        path = Path(run_dir) / name
        if path.exists():
            return json.loads(path.read_text())
    raise SettingsError(f"{run_dir}: no config.json or config-stage0.json (not a run directory?)")


def run_settings(run_dir: str | Path) -> dict[str, Any]:
    """The training settings the run was started with (stage0's config for a split run); {} if none."""
    try:
        return run_config(run_dir)["settings"]
    except SettingsError:
        return {}


NOT_TRAINING_KINDS = frozenset({"eval_heads"})
"""Message kinds that are not training's: evaluation during training. Their bytes are metered under their
own names and left out of the training figures unless asked for (``everything=True``)."""


def _meter_sum(record: dict[str, Any], prefix: str, direction: str | None, what: str, everything: bool) -> int:
    suffix = f"/{direction}_{what}" if direction else f"_{what}"
    return sum(v for k, v in record.items() if k.startswith(prefix) and k.endswith(suffix)
               and (everything or k[len(prefix):].partition("/")[0] not in NOT_TRAINING_KINDS))


def link_bytes(record: dict[str, Any], direction: str | None = None, *, everything: bool = False) -> int:
    """Training's bytes on the link up to this record: stage0's meters see what it sent and received.

    ``direction``: ``"sent"`` or ``"recv"`` (as stage0 sees it); None: both. ``everything``: evaluation's
    bytes too (`NOT_TRAINING_KINDS`), as the kernel counts them.
    """
    return _meter_sum(record, "net_total/", direction, "bytes", everything)


def link_messages(record: dict[str, Any], direction: str | None = None, *, everything: bool = False) -> int:
    """Messages on the link up to this record (``direction`` and ``everything`` as in `link_bytes`)."""
    return _meter_sum(record, "net_total/", direction, "messages", everything)


def iteration_bytes(record: dict[str, Any]) -> int:
    """Training's bytes on the link during this record's iteration, both directions."""
    return _meter_sum(record, "net/", None, "bytes", False)


def iteration_messages(record: dict[str, Any], direction: str | None = None) -> int:
    """Training's messages on the link during this record's iteration (``direction`` as in `link_bytes`)."""
    return _meter_sum(record, "net/", direction, "messages", False)


def measured_records(records: Sequence[dict[str, Any]], skip_first: bool = True,
                     skip_last: bool = False) -> Sequence[dict[str, Any]]:
    """The iterations per-iteration means are taken over: all but the first when there are two or more
    (``skip_first``), because the first pays for the processes' start-up (connections, allocator, caches);
    with ``skip_last`` also all but the last when one is left after that, because the asynchronous
    schedule's last iteration trains with no rollout beside it (its first collects with no training)."""
    used = records[1:] if skip_first and len(records) >= 2 else records
    return used[:-1] if skip_last and len(used) >= 2 else used


EMA_DECAY = 0.9
"""The paper smooths episodic returns with an EMA of this decay, one update per episode (stage0 keeps it,
`splitrl.stages.Edge`; a fleet's summary recomputes it over every edge's episodes)."""
