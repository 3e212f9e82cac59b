"""Whether `torch.compile` makes the paper's parts faster on this CPU than the kernels a run can already choose.

    python benchmarks/compile_probe.py [--rounds 2] [--count 30]

Issue 38's fourth item: a well-kept route to faster parts, kept behind an option if it pays. The largest part of an
iteration is the encoder's training (`splitrl bench floor`), a forward and backward of micro-batches of 64; the
heads' is next. Each network is timed (thread CPU, one intra-op thread) as eager, eager channels-last (the run's
``--channels-last``), and compiled by `torch.compile` (inductor, its default mode) from each, the rounds
alternating; then the encoder's acting forward on one observation. Also printed: how far the compiled networks'
outputs are from the eager ones' (inductor fuses and reorders, so not always bit for bit). The compile itself
(about 20 s a graph here, less once inductor's on-disk cache holds it) is paid once per process and shape.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from splitrl.devices import place
from splitrl.envs import inspect_env
from splitrl.models import agent
from splitrl.settings import TrainSettings


def thread_ms(call: Callable[[], object], count: int) -> float:
    """Thread-CPU milliseconds of one ``call``, the mean of ``count`` after three to warm up."""
    for _ in range(3):
        call()
    start = time.thread_time()
    for _ in range(count):
        call()
    return 1e3 * (time.thread_time() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--count", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)
    cpu = torch.device("cpu")
    batch = settings.steps_per_iteration // settings.ppo.minibatches // 2  # a micro-batch of the paper's minibatch
    obs = torch.randint(0, 256, (batch,) + tuple(spec.row_shape), dtype=getattr(torch, spec.row_dtype))
    encoders = {"eager": place(agent(settings, spec)[0], cpu, False),
                "eager, channels-last": place(agent(settings, spec)[0], cpu, True)}
    heads = {"eager": agent(settings, spec)[1].outputs}  # (actor output, value) of the features
    with torch.no_grad():
        features = encoders["eager"](obs)
    cut = features.clone().requires_grad_(True)  # the heads' input as the split hands it: a leaf

    def encoder_step(net: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        return lambda: net(obs).sum().backward()

    def heads_step(net: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
        def step() -> None:
            mean, value = net(cut)
            (mean.sum() + value.sum()).backward()
        return step

    for table, step in ((encoders, encoder_step), (heads, heads_step)):
        for name in list(table):
            table[f"compiled from {name}"] = compiled = torch.compile(table[name])
            step(compiled)()  # the compile: tens of seconds a graph, unless inductor's cache has it already

    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, net in encoders.items():
            rows.setdefault(f"encoder forward and backward, {batch} rows, {name}", []).append(
                thread_ms(encoder_step(net), args.count))
        for name, net in heads.items():
            rows.setdefault(f"heads forward and backward, {batch} rows, {name}", []).append(
                thread_ms(heads_step(net), args.count))
        with torch.no_grad():
            for name, net in encoders.items():
                rows.setdefault(f"encoder acting forward, 1 row, {name}", []).append(
                    thread_ms(lambda: net(obs[:1]), 10 * args.count))
    print(f"thread CPU ms a call, one intra-op thread, torch {torch.__version__}; rounds alternate")
    print("| call | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " |")
    print("|---|" + "---:|" * args.rounds)
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.3f}" if v < 1 else f"{v:.2f}" for v in values) + " |")
    with torch.no_grad():
        for name in ("eager", "eager, channels-last"):
            diff = (encoders[f"compiled from {name}"](obs) - encoders[name](obs)).abs().max().item()
            print(f"encoder compiled from {name}: largest difference from its eager output {diff:.3g}")
        diff = max((c - e).abs().max().item() for c, e in zip(heads["compiled from eager"](features),
                                                                 heads["eager"](features)))
        print(f"heads compiled: largest difference from their eager outputs {diff:.3g}")


if __name__ == "__main__":
    main()
