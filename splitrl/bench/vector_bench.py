"""``splitrl bench vector``: rollout steps per second with the envs in this process or in worker processes.

The rollout of the synchronous schedule without its link: the paper network's encoder
(`Edge`) and heads (`Learner`) in one process, `observe` -> `act` -> `step` for every env
step, at 1, 4 and 8 envs, with ``--vector sync`` (gymnasium's SyncVectorEnv) and
``--vector async`` (AsyncVectorEnv: one worker process per env). Each configuration
starts after a few warm-up steps (worker start-up, first allocations) and is timed over
the same number of samples; the table is in docs/benchmarks/vector.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ..envs import inspect_env
from ..settings import VECTOR_MODES, EnvSettings, PPOSettings, TrainSettings
from ..stages import Edge, Learner
from ..transport import Message

__all__ = ["run_vector_bench", "vector_table"]

WARMUP_STEPS = 8


def _rollout_rate(num_envs: int, vector: str, samples: int, env_id: str, threads: int) -> dict[str, Any]:
    steps = max(1, samples // num_envs)
    settings = TrainSettings(env=EnvSettings(env_id=env_id, num_envs=num_envs),
                             ppo=PPOSettings(num_steps=WARMUP_STEPS + steps))
    spec = inspect_env(settings.env)
    torch.set_num_threads(threads)
    edge, learner = Edge(settings, spec, vector=vector), Learner(settings, spec)
    edge.open_envs()
    try:
        edge.begin_rollout(1)
        learner.begin_rollout(1)
        cpu = wall = 0.0
        for t in range(WARMUP_STEPS + steps):
            if t == WARMUP_STEPS:
                wall, cpu = time.perf_counter(), time.process_time()
            tensors, header = edge.observe(t)
            action, _ = learner.act(t, Message("step", header, tensors))
            edge.step(Message("action", {}, action))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        edge.close()
    return {"num_envs": num_envs, "vector": vector, "samples": steps * num_envs, "seconds": wall,
            "samples_per_s": steps * num_envs / wall, "main_process_cpu_s": cpu}


def run_vector_bench(env_counts: Sequence[int] = (1, 4, 8), samples: int = 512, env_id: str = "CarRacing-v3",
                     threads: int = 2, progress=None) -> list[dict[str, Any]]:
    """One row per (envs, vector mode), the modes of one env count measured back to back."""
    rows = []
    for n in env_counts:
        for vector in VECTOR_MODES:
            rows.append(_rollout_rate(n, vector, samples, env_id, threads))
            if progress is not None:
                progress(rows[-1])
    return rows


def vector_table(rows: list[dict[str, Any]]) -> str:
    sync = {r["num_envs"]: r["samples_per_s"] for r in rows if r["vector"] == "sync"}
    lines = ["| envs | --vector | samples | s | samples/s | x sync | main-process CPU s |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["samples_per_s"] / sync[r["num_envs"]] if r["num_envs"] in sync else float("nan")
        lines.append(f"| {r['num_envs']} | {r['vector']} | {r['samples']} | {r['seconds']:.1f} | "
                     f"{r['samples_per_s']:.1f} | {ratio:.2f} | {r['main_process_cpu_s']:.1f} |")
    return "\n".join(lines)
