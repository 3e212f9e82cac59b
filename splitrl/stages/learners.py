"""Stage1 as one learner or as several: data-parallel learners kept in step by torch.distributed.

A fleet's stage1 may outgrow one machine. Started by ``torchrun`` (``torchrun --nproc-per-node L -m splitrl
stage1 --edges N ...``, or ``splitrl run --learners L --edges N``), each of the L processes is a learner
that serves its own edges (`edge_range`: learner r those of ids r N / L .. (r + 1) N / L - 1, each on its
port pair ``PORT + 2 x id``) and every learner holds the same heads. torch.distributed (gloo: CPU tensors,
TCP between the learners) carries what they must agree on, and nothing else:

- the rollout: each learner fills the rows of its edges' envs; the buffers are added up (`merge_rollout`:
  a row is nonzero on one learner only), so every learner computes the same advantages, normalises them
  over the same minibatches, and draws the same minibatches (`splitrl.ppo.minibatch_schedule`);
- each minibatch: every learner takes the loss of its edges' shares, weighted by the share's size in the
  whole minibatch as one learner would (`Learner.loss`); the heads' gradients and the loss statistics are
  summed (`sum_`) before the one optimizer step each learner takes: the same step everywhere;
- the edges' encoder: ``--encoder-sync grad`` sums the edges' gradients on each learner, then across them;
  ``avg`` sums their changes and counts them across learners before the mean: one encoder over every
  learner's edges;
- at the start: the same settings and the iteration a resumed fleet goes on after (`agree`, `newest_common`);
  after each iteration, a digest of the heads (`same_weights`: learners that drifted apart stop).

The actions are drawn per edge and step (`Learner.step_generator`, as ``--act-wait`` does): what one learner
draws for an edge does not depend on which learner serves it. With two learners each sum has two terms, and
a + b is b + a in floating point: two learners of one edge each end bit for bit where one learner of both
edges with ``--act-wait`` ends (tests/schedule/test_learners.py).

One learner (`Learners()`, the default) does none of this: every method returns at once.

Not supported across learners (refused, `SettingsError`): edges that come and go (``--min-edges`` below the
fleet, ``--rejoin``): an edge lost ends the run, as one lost from a fleet without ``--min-edges`` does.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from typing import Any, Iterable, Sequence

import torch

from ..errors import SettingsError
from .digest import digests

__all__ = ["Learners", "edge_range"]

log = logging.getLogger(__name__)


def edge_range(edges: int, learners: int, rank: int) -> range:
    """The ids of the edges that learner ``rank`` of ``learners`` serves out of a fleet of ``edges``."""
    return range(rank * edges // learners, (rank + 1) * edges // learners)


class Learners:
    """This process's place among stage1's learners: ``rank`` of ``world``. ``Learners()`` is the one learner."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world

    @staticmethod
    def world_size(expected: int = 1) -> int:
        """How many learners ``torchrun`` started (``WORLD_SIZE`` in the environment; 1 without torchrun);
        ``expected``: the learners ``--learners`` asks for (1: as many as torchrun started)."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        except ValueError:
            raise SettingsError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment is not a number of "
                                "learners") from None
        if expected > 1 and world != expected:
            raise SettingsError(f"--learners {expected}: start stage1 with `torchrun --nproc-per-node {expected} -m "
                                f"splitrl stage1 ...` (or `splitrl run --learners {expected}`); this process is one "
                                f"of {world}")
        return world

    @classmethod
    def from_environment(cls, timeout: float, expected: int = 1) -> "Learners":
        """One learner, or, in a process ``torchrun`` started (`world_size` > 1), this learner's place after
        joining the others (gloo; the rendezvous ``torchrun`` set up). ``timeout``: seconds any exchange between
        the learners may wait for the slowest before the run fails."""
        if cls.world_size(expected) <= 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            raise SettingsError("several learners need torch.distributed with gloo, which this torch lacks")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        rank, world = dist.get_rank(), dist.get_world_size()
        log.info("[stage1] learner %d of %d (torch.distributed, gloo)", rank, world)
        return cls(rank, world)

    @property
    def alone(self) -> bool:
        return self.world == 1

    def close(self) -> None:
        if not self.alone:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    # -- the collectives -------------------------------------------------------------------
    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Each tensor replaced in place by its sum over the learners (one all-reduce for all of each dtype)."""
        if self.alone or not tensors:
            return
        import torch.distributed as dist

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat)
            start = 0
            for t in group:
                t.copy_(flat[start:start + t.numel()].view_as(t))
                start += t.numel()

    def sum_named(self, tensors: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Named tensors summed over the learners, in ``like``'s order (a name this learner lacks adds zeros
        shaped as in ``like``); ``tensors`` itself when alone."""
        if self.alone:
            return tensors
        total = {name: tensors.get(name, torch.zeros_like(t)) for name, t in like.items()}
        self.sum_(list(total.values()))
        return total

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The parameters' gradients summed over the learners (a learner with no share of a minibatch adds
        zeros)."""
        if self.alone:
            return
        params = list(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.sum_([p.grad for p in params])

    def sum_stats(self, parts: dict[str, float], keys: Sequence[str]) -> dict[str, float]:
        """Statistics taken in parts (each learner's share of a minibatch), summed over the learners: ``keys``
        in a fixed order, so that a learner with no part adds zeros; {} if no learner had a part."""
        if self.alone:
            return parts
        unknown = set(parts) - set(keys)
        if unknown:
            raise ValueError(f"statistics the learners do not sum: {sorted(unknown)}")
        vector = torch.tensor([1.0 if parts else 0.0] + [parts.get(k, 0.0) for k in keys], dtype=torch.float64)
        self.sum_([vector])
        return dict(zip(keys, vector[1:].tolist())) if vector[0] > 0 else {}

    def sum_count(self, count: int) -> int:
        if self.alone:
            return count
        total = torch.tensor([count], dtype=torch.int64)
        self.sum_([total])
        return int(total)

    def agree(self, value: Any, what: str) -> None:
        """SettingsError unless every learner has the same ``value`` (JSON-able) for ``what``."""
        if self.alone:
            return
        import torch.distributed as dist

        digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:7], "big")], dtype=torch.int64)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if int(low) != int(high):
            raise SettingsError(f"the {self.world} learners differ in {what}: start every learner with the same "
                                "options (torchrun gives each the same command line)")

    def same_weights(self, module: torch.nn.Module, what: str) -> None:
        """`agree` on a digest of ``module``'s parameters and buffers: learners whose copies drifted apart (which the
        summed steps should never let happen) stop, rather than train on as different learners."""
        if self.alone:
            return
        self.agree(digests(module.state_dict().items()), what)

    def newest_common(self, held: Iterable[int]) -> int:
        """The newest iteration (>= 1) that every learner has in ``held``; 0 if none."""
        held = {i for i in held if i > 0}
        if self.alone:
            return max(held, default=0)
        import torch.distributed as dist

        last = torch.tensor([max(held, default=0)], dtype=torch.int64)
        dist.all_reduce(last, op=dist.ReduceOp.MAX)
        mask = torch.tensor([0] + [1 if i in held else 0 for i in range(1, int(last) + 1)], dtype=torch.int64)
        dist.all_reduce(mask, op=dist.ReduceOp.MIN)
        common = mask.nonzero().reshape(-1)
        return int(common.max()) if len(common) else 0

    # -- the rollout -------------------------------------------------------------------------
    def merge_rollout(self, learner: Any, envs: torch.Tensor) -> None:
        """Every learner's rollout in every learner's buffer: ``envs`` are the env columns this learner's edges
        filled; the others are zeroed here and filled by the sum (`Learner.buffer`, its bootstrap values)."""
        if self.alone:
            return
        buffer = learner.buffer
        others = torch.ones(buffer.num_envs, dtype=torch.bool)
        others[envs] = False
        parts = [buffer.actions, buffer.logprobs, buffer.values, buffer.rewards, buffer.terminated,
                 buffer.truncated, buffer.final_values]
        for t in parts:
            t[:, others] = 0
        last = learner.rollouts.last_values[learner.iteration]
        last[others] = 0
        self.sum_(parts + [last])
