"""What taking turns between two processes costs a synchronous rollout, with nothing else around it.

    python benchmarks/turns.py --steps 1024 --rounds 3

The synchronous split's rollout is one env stepped by stage0, the encoder's forward on its observation, the
features to stage1, the heads' forward and draw there, the action back: 4,096 round trips an iteration, each side
asleep while the other works. `splitrl bench floor` times these parts in one process, one after the other
(``one process``). Here the same parts (the paper's env pipeline and networks, one intra-op thread a process) also
run in two processes that take turns at every step through a pipe, raw bytes each way and nothing else: no
framing, checks, storage or codec (``two processes``). The two settings alternate for ``--rounds`` rounds. Printed
per setting, in microseconds a step: each part's thread CPU, the processes' CPU in all, and the rest (``turns``:
the pipe's system calls, sleeping and waking, and whatever each part costs more for having slept). The split's
rollout costs what this does, plus what splitrl adds around the parts (`docs/benchmarks/floor.md`).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

PARTS = ("env", "encoder", "heads")
START = b"start"
"""The edge's word that its warm-up is over (features are thousands of bytes; an empty message stops the heads)."""


def _build():
    """The paper's settings as a run resolves them, its env's spec and both halves of its network, on one thread."""
    import torch

    from splitrl.envs import inspect_env
    from splitrl.models import agent
    from splitrl.settings import TrainSettings

    torch.set_num_threads(1)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)
    return (settings, spec, *agent(settings, spec))


def _edge(conn, steps: int, out) -> None:
    """The env and the encoder; the heads in this process (``conn`` None) or across the pipe."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `python -m splitrl` runs, before torch loads
    import numpy as np
    import torch

    from splitrl.stages.env_groups import training_envs

    settings, spec, encoder, heads = _build()
    envs, _ = training_envs(settings)
    stacked = settings.env.image_pipeline[1] > 1
    generator = torch.Generator().manual_seed(settings.seed)
    obs, _ = envs.reset(seed=settings.seed)
    seconds = dict.fromkeys(PARTS, 0.0)

    def step() -> None:
        nonlocal obs
        clock = time.thread_time()
        x = torch.as_tensor(spec.rows(obs, stacked))
        with torch.no_grad():
            features = encoder(x)
            now = time.thread_time()
            seconds["encoder"] += now - clock
            if conn is None:
                action = heads.evaluate(*heads.outputs(features), generator=generator)[0]
                clock = time.thread_time()
                seconds["heads"] += clock - now
            else:
                conn.send_bytes(features.numpy().tobytes())
                action = torch.frombuffer(bytearray(conn.recv_bytes()), dtype=torch.float32).view(1, -1)
                clock = time.thread_time()
        obs, *_ = envs.step(spec.env_action(action.numpy(), settings.env.action_map))
        seconds["env"] += time.thread_time() - clock

    for _ in range(8):  # warm-up: allocations, oneDNN's primitives
        step()
    if conn is not None:  # both sides' clocks start here
        conn.send_bytes(START)
        conn.recv_bytes()
    seconds.update(dict.fromkeys(PARTS, 0.0))
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    envs.close()
    if conn is not None:
        conn.send_bytes(b"")  # the heads' side stops
    out.put(("edge", cpu, wall, seconds))


def _heads(conn, out) -> None:
    """The heads' forward and draw for each features that come, the action back, until an empty message."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    settings, _, _, heads = _build()
    generator = torch.Generator().manual_seed(settings.seed)
    seconds, cpu = 0.0, time.process_time()
    while True:
        data = conn.recv_bytes()
        if not data:
            break
        if data == START:  # the edge's warm-up is over
            seconds, cpu = 0.0, time.process_time()
            conn.send_bytes(START)
            continue
        clock = time.thread_time()
        with torch.no_grad():
            features = torch.frombuffer(bytearray(data), dtype=torch.float32).view(1, -1)
            action = heads.evaluate(*heads.outputs(features), generator=generator)[0]
        seconds += time.thread_time() - clock
        conn.send_bytes(action.numpy().tobytes())
    out.put(("heads", time.process_time() - cpu, 0.0, {"heads": seconds}))


def measure(steps: int, two: bool) -> dict[str, float]:
    """One setting: CPU seconds by part, the processes' CPU in all and the edge's wall seconds over ``steps``."""
    ctx = mp.get_context("spawn")  # fresh interpreters with one intra-op thread each
    results = ctx.Queue()
    if two:
        a, b = ctx.Pipe()
        sides = [ctx.Process(target=_edge, args=(a, steps, results)), ctx.Process(target=_heads, args=(b, results))]
    else:
        sides = [ctx.Process(target=_edge, args=(None, steps, results))]
    for p in sides:
        p.start()
    got = [results.get(timeout=900) for _ in sides]
    for p in sides:
        p.join(timeout=60)
    parts = dict.fromkeys(PARTS, 0.0)
    cpu = wall = 0.0
    for role, role_cpu, role_wall, seconds in got:
        cpu += role_cpu
        wall = max(wall, role_wall)
        for part, s in seconds.items():
            parts[part] += s
    return {**parts, "cpu": cpu, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    us = 1e6 / args.steps
    print(f"{args.steps} env steps a setting, one intra-op thread a process; microseconds a step")
    print("| setting | env | encoder | heads | parts | CPU in all | turns | wall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for name, two in (("one process", False), ("two processes", True))[:: 1 if r % 2 == 0 else -1]:
            m = measure(args.steps, two)
            parts = sum(m[p] for p in PARTS)
            print(f"| {name} | {m['env'] * us:.0f} | {m['encoder'] * us:.0f} | {m['heads'] * us:.0f} | "
                  f"{parts * us:.0f} | {m['cpu'] * us:.0f} | {(m['cpu'] - parts) * us:.0f} | {m['wall'] * us:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
