"""A tiny split run against its single-process twin: the same checkpoints and metrics, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from splitrl.launch import free_port_pair
from splitrl.runs import load_checkpoint

from ..conftest import TINY, splitrl_here

__all__ = ["split_matches_twin"]


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cpu/")) and k != "charts/SPS"} for r in rows]


def split_matches_twin(tmp_path: Path, spawn, *options: str) -> list[dict]:
    """Train TINY with ``options`` as stage0 + stage1 over ZeroMQ (``spawn``: the conftest's `spawn` or
    `spawn_warm`) and as `splitrl train` in this process (the process boundary is the split run's); assert both
    stages' last checkpoints and the metrics are equal; return the split run's metrics."""
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    args = TINY + ["--timeout", "60", "--start-timeout", "60", *options]
    split_dir, twin_dir = tmp_path / "split", tmp_path / "twin"
    s1 = spawn("stage1", "--bind", endpoint, "--run-dir", str(split_dir), *args)
    s0 = spawn("stage0", "--connect", endpoint, "--run-dir", str(split_dir), *args)
    code0, out0 = s0.finish(timeout=240)
    code1, out1 = s1.finish(timeout=30)
    assert code0 == 0, out0
    assert code1 == 0, out1
    splitrl_here("train", "--run-dir", str(twin_dir), *args)
    for stage, key in (("stage0", "net"), ("stage1", "heads")):
        split_state, twin_state = load_checkpoint(split_dir, stage, 2)[key], load_checkpoint(twin_dir, stage, 2)[key]
        assert split_state.keys() == twin_state.keys()
        for name in split_state:
            assert torch.equal(split_state[name], twin_state[name]), f"{stage}.{name}"
    split_metrics = _metrics(split_dir)
    assert len(split_metrics) == 2 and split_metrics == _metrics(twin_dir)
    return split_metrics
