"""Run directories: writing them (`RunLog`) and reading them back (metrics, bytes on the link).

A run directory holds config.json (config-stage0.json / config-stage1.json for
split runs), metrics.jsonl (one line per iteration), episodes.jsonl (one line
per finished episode) and checkpoints/.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

__all__ = ["RunLog", "default_run_dir", "read_metrics", "link_bytes"]


def default_run_dir(env_id: str) -> str:
    return str(Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{env_id.replace('/', '_')}")


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write null so every line parses with a strict reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLog:
    """Append-only JSON-lines files in one directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: dict[str, Any], name: str = "config.json") -> None:
        (self.dir / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open(self.dir / name, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def metrics(self, record: dict[str, Any]) -> None:
        self._append("metrics.jsonl", record)

    def episode(self, record: dict[str, Any]) -> None:
        self._append("episodes.jsonl", record)

    def checkpoint(self, stage: str, iteration: int, state: dict[str, Any]) -> Path:
        path = self.dir / "checkpoints" / f"{stage}-iter{iteration:05d}.pt"
        path.parent.mkdir(exist_ok=True)
        import torch  # reading a run directory needs no torch

        torch.save(state, path)
        return path


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a splitrl run directory?)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break  # a run still writing its last line
            raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
    return records


def link_bytes(record: dict[str, Any]) -> int:
    """Bytes on the link up to this record, both directions: stage0's meters see what it sent and received."""
    return sum(v for k, v in record.items() if k.startswith("net_total/") and k.endswith("_bytes"))
