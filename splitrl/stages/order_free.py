"""Acting for a fleet as its edges come: the same actions whoever came together, in whatever order.

Stage1 may act for a fleet's edges in batches made of whichever edges' steps have arrived
(``--act-wait``, several learners). An action must not depend on that: each group's step draws from
a generator of its own (`step_generator`: the run's seed, the iteration, the group and the step
alone), and the heads' forward runs on a batch padded to a size that gives every row the numbers
it gets in any other such batch (`batch_invariant`).

The padding rule: on one intra-op thread, torch's CPU matrix products give a row the same numbers
in every batch of at least `BATCH_INVARIANT_ROWS` rows whose count is a multiple of
`BATCH_INVARIANT_MULTIPLE`, wherever the row sits; in any other batch (fewer rows, or a count off
the multiple) some rows get other numbers in the last bits, and on two threads other sizes differ
too. tests/schedule/test_fleet_stages.py checks the rule on the machine it runs on.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..devices import one_thread

__all__ = ["BATCH_INVARIANT_ROWS", "BATCH_INVARIANT_MULTIPLE", "batch_invariant", "invariant_rows",
           "step_generator"]

BATCH_INVARIANT_ROWS = 16
"""The fewest rows of a batch that gives a row its numbers: enough for the heads' 4,096-wide first layers on
CPUs with the widest vector units."""
BATCH_INVARIANT_MULTIPLE = 4
"""A batch's row count is a multiple of this: the critic's one-output layer takes another kernel for a batch's
last ``n % 4`` rows."""

_MASK64 = (1 << 64) - 1


def invariant_rows(rows: int) -> int:
    """The batch `batch_invariant` pads ``rows`` rows to."""
    return max(BATCH_INVARIANT_ROWS, -(-rows // BATCH_INVARIANT_MULTIPLE) * BATCH_INVARIANT_MULTIPLE)


def batch_invariant(forward: Callable[[torch.Tensor], Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``forward(x)`` on one intra-op thread, ``x`` padded with zero rows to `invariant_rows`."""
    rows = len(x)
    padded = invariant_rows(rows)
    if padded > rows:
        x = torch.cat([x, x.new_zeros((padded - rows,) + tuple(x.shape[1:]))])
    with one_thread():
        return tuple(out[:rows] for out in forward(x))


def step_generator(seed: int, iteration: int, g: int, t: int) -> torch.Generator:
    """A generator for group ``g``'s step ``t`` of ``iteration``, seeded by those and the run's ``seed`` alone (a
    splitmix64-style mix, so that nearby steps get unrelated streams)."""
    h = 0x9E3779B97F4A7C15
    for part in (seed, iteration, g, t):
        h = (h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h ^= h >> 31
    return torch.Generator().manual_seed(h & 0x7FFF_FFFF_FFFF_FFFF)
