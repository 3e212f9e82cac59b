"""The run directory: config.json, metrics.jsonl, episodes.jsonl, checkpoints/."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["RunLog", "default_run_dir"]


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
        torch.save(state, path)
        return path
