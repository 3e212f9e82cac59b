"""PPO's optimizer: Adam as CleanRL's (eps 1e-5), stepping all of its tensors at once."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def adam(params: Iterable[Any], lr: float, eps: float = 1e-5, fused: bool = False) -> torch.optim.Adam:
    """Adam over ``params`` (tensors, or param groups) with torch's multi-tensor update (``foreach``), which CUDA
    gets by default and CPU does not: on CPU it computes every value as the one-tensor-at-a-time loop does (bit for
    bit: tests/ppo/test_optimizer.py) with fewer passes over memory. The heads' 4.2 M parameters on one thread:
    24.8 -> 17.0 ms a step, 2.5 s of a paper iteration's 320 steps (docs/benchmarks/floor.md).

    ``fused`` (``--fused-adam``): torch's fused kernel, one pass over each tensor, 3.0 ms a step there; its values
    differ from the loop's in the last bits of each step (tests/ppo/test_optimizer.py bounds how far)."""
    if fused:
        return torch.optim.Adam(params, lr=lr, eps=eps, fused=True)
    return torch.optim.Adam(params, lr=lr, eps=eps, foreach=True)
