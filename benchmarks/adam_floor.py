"""The floor's parts with each Adam: torch's CPU default (one tensor at a time), splitrl's (``foreach``) and
``--fused-adam``, one after the other in one process (`splitrl.bench.floor_bench.measure_floor` each time).

    python benchmarks/adam_floor.py

Prints each variant's parts (CPU seconds an iteration) and one JSON object. Only the training parts use Adam; the
others show how far the machine drifted meanwhile.
"""

from __future__ import annotations

import json

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


def main() -> None:
    parts = {}
    for name, make in VARIANTS.items():
        floor_bench.adam = make  # the name floor_bench builds its optimizers with
        parts[name] = floor_bench.measure_floor(TrainSettings())["parts"]
        print(name, {k: round(v, 2) for k, v in parts[name].items()}, flush=True)
    print(json.dumps(parts))


if __name__ == "__main__":
    main()
