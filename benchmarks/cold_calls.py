"""What a stage's per-step calls cost when the process comes back to them cold, against the same calls in a loop.

    python benchmarks/cold_calls.py [--count 300] [--pause-ms 4]

In the synchronous split each process waits through the other's turn at every env step: stage1 while stage0
steps the env (about 5 ms of rendering and physics), stage0 while stage1 acts. What ran meanwhile (the other
process, on this core or the one beside it) has taken the caches, so each call after the wake-up finds its code
and data cold. Each call here is timed (thread CPU) right after such a pause (a 64 MiB buffer read, then a spin
of ``--pause-ms``) and in a tight loop (warm); the ratio is what the wake-ups of 4,096 round trips an iteration
multiply. Calls: a 16 KiB frame as a torch tensor (`torch.frombuffer`); the wire's decode of a rollout step as
the synchronous split sends it (features, reward, terminated, truncated); the paper's heads' acting forward and
draw on one row (the floor's ``heads acting`` part, `splitrl bench floor`); `Learner.act` on that step (the
part and the bookkeeping around it: the outcome read and checked, the draw scored, the rollout's rows stored);
and on stage0's side the encoder's acting forward on one observation (a part) and `Edge.observe` (the part and
its bookkeeping: the observation stored, the features packed for the wire).
One thread. Prints a markdown table, with the torch operators each call dispatches (``torch calls``: counted once,
with a `TorchDispatchMode`, outside the timing).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable

import numpy as np
import torch

from splitrl.envs import inspect_env
from splitrl.settings import TrainSettings
from splitrl.stages import Edge, Learner
from splitrl.transport.wire import decode, encode


def timed(call: Callable[[], object], count: int, pause_s: float) -> tuple[float, float]:
    """(cold, warm) thread-CPU microseconds of one ``call``: the mean over ``count`` calls after a pause, and
    over ``10 * count`` calls back to back."""
    evict = np.ones(8 << 20)  # 64 MiB: more than the last-level cache
    cold = 0.0
    for _ in range(count):
        evict.sum()
        until = time.perf_counter() + pause_s
        while time.perf_counter() < until:
            pass
        start = time.thread_time()
        call()
        cold += time.thread_time() - start
    for _ in range(count):
        call()
    start = time.thread_time()
    for _ in range(10 * count):
        call()
    warm = (time.thread_time() - start) / (10 * count)
    return 1e6 * cold / count, 1e6 * warm


def torch_calls(call: Callable[[], object]) -> int:
    """How many torch operators one ``call`` dispatches (views and copies too: each is a call into torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.count += 1
            return func(*args, **(kwargs or {}))

    with Count():
        call()
    return Count.count


def step_calls(opened: contextlib.ExitStack) -> tuple[dict, list[tuple[str, Callable[[], object]]]]:
    """A rollout step as the synchronous split sends it (features, reward, flags) and the per-step calls on it, on
    one thread: the wire's decode of the step, the heads' part, `Learner.act`, the encoder's part, `Edge.observe`
    (the env it opens is closed by ``opened``). Built from the stages' classes alone, so that
    `benchmarks/step_instructions.py` runs the same calls in an older revision's tree."""
    torch.set_num_threads(1)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    learner = Learner(settings, spec)
    learner.begin_rollout(1)
    features = torch.randn(1, learner.feature_dim, generator=torch.Generator().manual_seed(0))
    step = {"features": features, "reward": torch.zeros(1), "terminated": torch.zeros(1, dtype=torch.bool),
            "truncated": torch.zeros(1, dtype=torch.bool)}
    frames = [bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in encode("step", 1, {"t": 1}, step)]
    message = decode(frames)
    t = iter(range(1, 1 << 30))

    def act() -> object:
        return learner.act(next(t) % (settings.ppo.num_steps - 1) + 1, message)

    def heads() -> object:
        with torch.no_grad():
            return learner.heads.evaluate(*learner.heads.outputs(features), generator=learner.generator)

    settings = settings.for_observation(spec.observation)  # stage0's side: the model the run resolves
    edge = Edge(settings, spec)
    opened.callback(edge.close)
    edge.open_envs()
    edge.begin_rollout(1)
    observation = torch.as_tensor(spec.rows(edge.envs.next_obs[0], settings.env.image_pipeline[1] > 1))

    def encoder() -> object:
        with torch.no_grad():
            return edge.acting(observation)

    return step, [("wire decode of a step", lambda: decode(frames)),
                  ("heads' acting forward and draw (a part)", heads),
                  ("Learner.act (the part and its bookkeeping)", act),
                  ("encoder's acting forward (a part)", encoder),
                  ("Edge.observe (the part and its bookkeeping)", lambda: edge.observe(1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--pause-ms", type=float, default=4.0)
    args = parser.parse_args()
    with contextlib.ExitStack() as opened:
        step, calls = step_calls(opened)
        frame = bytearray(step["features"].numpy().tobytes())
        calls.insert(0, ("torch.frombuffer, 16 KiB", lambda: torch.frombuffer(frame, dtype=torch.float32)))
        print(f"thread CPU us a call, after a {args.pause_ms:g} ms pause that evicts the caches, and back to back")
        print("| call | cold | warm | cold / warm | torch calls |")
        print("|---|---:|---:|---:|---:|")
        for name, call in calls:
            cold, warm = timed(call, args.count, args.pause_ms / 1e3)
            print(f"| {name} | {cold:.1f} | {warm:.1f} | {cold / warm:.1f}x | {torch_calls(call)} |")


if __name__ == "__main__":
    main()
