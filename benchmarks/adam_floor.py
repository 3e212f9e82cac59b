"""The floor's parts with each Adam: torch's CPU default (one tensor at a time), splitrl's (``foreach``) and
``--fused-adam``, one after the other in one process (`splitrl.bench.floor_bench.measure_floor` each time).

    python benchmarks/adam_floor.py [--rounds 2]     # the floor's parts, the variants interleaved
    python benchmarks/adam_floor.py --micro          # one step of the heads' 4.2 M parameters alone

Prints each variant's figures (CPU seconds an iteration of the parts; with ``--micro`` CPU milliseconds a step, and
how far the fused kernel's parameters are from the default's after 50 steps) and one JSON object. Only the
training parts use Adam; the others show how far the machine drifted meanwhile.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import splitrl.bench.floor_bench as floor_bench
from splitrl.ppo.optimizer import adam
from splitrl.settings import TrainSettings

VARIANTS = {
    "one tensor at a time": lambda params, lr, eps=1e-5, fused=False: torch.optim.Adam(params, lr=lr, eps=eps,
                                                                                        foreach=False),
    "foreach": lambda params, lr, eps=1e-5, fused=False: adam(params, lr, eps),
    "fused": lambda params, lr, eps=1e-5, fused=False: adam(params, lr, eps, fused=True),
}


HEADS = [(512, 4096), (512,), (1, 512), (1,), (512, 4096), (512,), (3, 512), (3,), (3,)]
"""The paper heads' parameters: a critic and an actor of 512 on a 4096-wide cut, and the log-std."""


def micro(steps: int = 50) -> dict[str, float]:
    """CPU ms a step of each variant on one thread (five gradients in turn), and the fused parameters' largest
    difference from the default's after ``steps`` steps."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=generator) for s in HEADS]
    grads = [[torch.randn(s, generator=generator) for s in HEADS] for _ in range(5)]
    out, final = {}, {}
    for name, make in VARIANTS.items():
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = make(params, 1e-5)
        began = time.process_time()
        for k in range(steps):
            for p, g in zip(params, grads[k % 5]):
                p.grad = g
            optimizer.step()
        out[f"{name} ms"] = (time.process_time() - began) / steps * 1e3
        final[name] = [p.detach() for p in params]
        print(f"{name}: {out[f'{name} ms']:.1f} ms a step", flush=True)
    out["fused max difference"] = max(float((a - b).abs().max()) for a, b in zip(final["fused"], final["foreach"]))
    out["foreach equal"] = all(torch.equal(a, b) for a, b in zip(final["foreach"], final["one tensor at a time"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", action="store_true", help="time one step of the heads' parameters alone")
    parser.add_argument("--rounds", type=int, default=2, help="floor runs of each variant, interleaved")
    args = parser.parse_args()
    if args.micro:
        print(json.dumps(micro()))
        return
    parts: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, make in VARIANTS.items():
            floor_bench.adam = make  # the name floor_bench builds its optimizers with
            parts[name].append(floor_bench.measure_floor(TrainSettings())["parts"])
            print(name, {k: round(v, 2) for k, v in parts[name][-1].items()}, flush=True)
    print(json.dumps(parts))


if __name__ == "__main__":
    main()
