"""PPO's optimizer: Adam as CleanRL's (eps 1e-5), stepping all of its tensors at once."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def adam(params: Iterable[Any], lr: float, eps: float = 1e-5, fused: bool = False) -> torch.optim.Adam:
    """Adam over ``params`` (tensors, or param groups) with torch's multi-tensor update (``foreach``), which CUDA
    gets by default and CPU does not: on CPU it computes every value as the one-tensor-at-a-time loop does (bit for
    bit: tests/ppo/test_optimizer.py) with fewer passes over memory. The heads' 4.2 M parameters on one thread:
    24.8 -> 17.0 ms a step alone (`python benchmarks/adam_floor.py --micro`; docs/benchmarks/floor.md).

    ``fused`` (``--fused-adam``): torch's fused kernel, one pass over each tensor, 3.0 ms a step there; its values
    differ from the loop's in the last bits of each step (tests/ppo/test_optimizer.py bounds how far)."""
    if fused:
        return torch.optim.Adam(params, lr=lr, eps=eps, fused=True)
    return torch.optim.Adam(params, lr=lr, eps=eps, foreach=True)


def load_adam_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(saved)`` but keeping the kernel the optimizer was built with: torch takes each
    group's options from the saved groups, so a checkpoint written with another kernel (one written before
    ``foreach``, or with or without ``--fused-adam``) would silently switch to its. The values do not depend on
    it (``foreach`` is the loop bit for bit; a fused run resumes fused, a setting a resume may not change)."""
    groups = [{**group, **{k: now[k] for k in ("foreach", "fused") if k in now}}
              for group, now in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**saved, "param_groups": groups})
