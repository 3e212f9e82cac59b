"""Stage1's per-step checks of a rollout step, with torch's reductions (as before 1b3e47b) and with numpy's (as
`splitrl.stages.limits` and `splitrl.stages.outcomes` read a step's few values now), after a pause that evicts the
caches and back to back.

    python benchmarks/cold_checks.py [--count 300] [--rounds 6] [--pause-ms 4]

Each way reads a step's outcome from its message, its reward (one value) and features (3,136 values, the paper's)
for their limits, and works out whether an env was cut short. Before, each limit was
``torch.stack(x.aminmax()).tolist()``, and the outcome came with zeros for its final values, put through the
storage's bootstrap mask ``torch.where(truncated & ~terminated, zeros, 0.0)`` on every step; now (the code's own
`read_outcome` and `EdgeLimits`) each limit is numpy's ``min`` and ``max`` of the tensor's values, and the mask is
worked out only when numpy finds an env truncated.
The two ways alternate round by round in one process (`benchmarks/cold_calls.py`'s pause); printed: thread-CPU
microseconds a call, each round's mean, cold and warm.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from splitrl.settings import ScheduleSettings
from splitrl.stages.limits import EdgeLimits
from splitrl.stages.outcomes import read_outcome
from splitrl.stages.protocol import tensor
from splitrl.transport import Message

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cold_calls import timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pause-ms", type=float, default=4.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    features = torch.randn(1, 3136, generator=torch.Generator().manual_seed(0))
    step = Message("step", {"t": 1}, {"features": features, "reward": torch.zeros(1),
                                      "terminated": torch.zeros(1, dtype=torch.bool),
                                      "truncated": torch.zeros(1, dtype=torch.bool)})
    limits, envs = EdgeLimits(ScheduleSettings()), slice(0, 1)

    def with_torch() -> object:  # read_outcome and the limits as they were, and the storage's mask
        reward, terminated, truncated = (tensor(step, name, (1,), dtype) for name, dtype in
                                         (("reward", torch.float32), ("terminated", torch.bool),
                                          ("truncated", torch.bool)))
        values = torch.zeros(1)
        for x, limit in ((reward, limits.reward), (features, limits.feature)):
            low, high = torch.stack(x.aminmax()).tolist()
            assert -limit <= low and high <= limit
        return torch.where(truncated & ~terminated, values, 0.0)

    def with_numpy() -> object:  # the code's own
        outcome = limits.outcome("step", read_outcome(step, envs, lambda index: index))
        return limits.features("step", "features", features), outcome

    ways = [("torch's reductions and the mask (before)", with_torch), ("numpy's (now)", with_numpy)]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in ways}
    for round_ in range(args.rounds):
        for name, call in ways if round_ % 2 == 0 else ways[::-1]:
            results[name].append(timed(call, args.count, args.pause_ms / 1e3))
    print(f"thread CPU us a step's checks, after a {args.pause_ms:g} ms pause that evicts the caches, and back to "
          f"back; {args.rounds} rounds alternated")
    print("| way | cold, each round | warm, each round |")
    print("|---|---|---|")
    for name, rows in results.items():
        print(f"| {name} | {', '.join(f'{cold:.1f}' for cold, _ in rows)} | "
              f"{', '.join(f'{warm:.1f}' for _, warm in rows)} |")


if __name__ == "__main__":
    main()
