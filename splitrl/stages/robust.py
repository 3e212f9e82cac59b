"""How stage1 adds up a fleet's encoder gradients (or changes): in edge order, or robustly.

A plain sum lets one edge move the shared encoder as far as it likes (within ``--edge-grad-limit``). With
``--encoder-sync grad:robust=trimmed`` or ``robust=median`` (federated learning's coordinate-wise trimmed
mean and median, Yin et al. 2018) each coordinate takes, over the N edges there, the mean without its
largest and its smallest value, or the median (of an even N, the mean of the two middle values), times N so
that the result is on the scale of the sum the learning rates were chosen for. One of N >= 3 edges then
moves a coordinate no further than the honest edges' values reach; with N = 2 there is nothing to trim and
the median is the mean, so both are the plain sum, and the plain sum is what is computed (the mean times 2
would lose the last bit of a subnormal sum).
"""

from __future__ import annotations

import torch

from ..settings.specs import ROBUST_SUMS

__all__ = ["combine"]


def _robust(stacked: torch.Tensor, how: str) -> torch.Tensor:
    """``how`` of the N >= 3 rows of ``stacked`` (N edges' values of one tensor), coordinate by coordinate, times
    N."""
    n = len(stacked)
    ordered = stacked.sort(dim=0).values
    if how == "trimmed":
        return ordered[1:-1].mean(dim=0) * n
    middle = ordered[(n - 1) // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return middle * n


def combine(parts: list[dict[str, torch.Tensor]], like: dict[str, torch.Tensor], how: str = "off"
            ) -> dict[str, torch.Tensor]:
    """The named tensors of ``parts`` (one dict per edge, each with ``like``'s names) added up in order
    (``how`` 'off'), or their coordinate-wise trimmed mean or median times their number ('trimmed', 'median');
    {} without parts."""
    if how not in ROBUST_SUMS:
        raise ValueError(f"a fleet's sum is one of {', '.join(ROBUST_SUMS)}, got {how!r}")
    if not parts:
        return {}
    if how == "off" or len(parts) <= 2:  # (two edges: nothing to trim, and their median is their mean)
        total: dict[str, torch.Tensor] = {}
        for part in parts:
            for name in like:
                total[name] = part[name].clone() if name not in total else total[name].add_(part[name])
        return total
    return {name: _robust(torch.stack([part[name] for part in parts]), how) for name in like}
