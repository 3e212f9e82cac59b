"""A minibatch's micro-batches through a network at once, on threads, with the numbers of one after another.

With ``--microbatches M > 1`` a stage takes each minibatch in M parts. Taken in turn, the parts keep one core
busy and leave the other waiting: stage0's encoder forwards part j + 1 only after part j, and back-propagates
part j + 1 only after part j, while stage1's heads wait for it (docs/benchmarks/floor.md, "Where each core
waits"). The parts are independent until the optimizer's step, so each stage hands them to `PartWorkers`: the
forward of every part at once, then each part's backward as its gradient comes back, each on a worker thread.

The numbers stay those of the parts taken in turn, bit for bit:

- each part's operations run on one worker with the stage's ``--threads`` intra-op threads, so a part gets the
  numbers it gets on the stage's own thread;
- a part's backward returns its gradients (`torch.autograd.grad`) instead of accumulating them into ``.grad``,
  and `add_in_order` sums them part by part, in the parts' order: what autograd's accumulation computes when the
  backwards run one after another (``grad = g0``, then ``grad += g1``, ...), whichever worker finished first.

A network is handed to workers only if every module in it is one that keeps no state and draws no random
numbers in its forward (`concurrent_safe`): a BatchNorm's running statistics or a Dropout's draws would depend
on which part ran first. Any other network takes its parts in turn, as before.

The workers are this process's (one pool, made when first needed): ``--part-workers`` of them, or by default as
many as the cores this process may run on hold ``--threads`` threads each, at least two; ``--part-workers 1``
takes the parts in turn.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from ..models.builtin import ResidualBlock
from ..models.heads import ActorCriticHeads
from ..models.layers import ImageStep, ScaleObs
from .common import PhaseClock

__all__ = ["PartWorkers", "configure", "part_workers", "worker_count", "concurrent_safe", "add_in_order"]

_STATELESS = (
    nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
    nn.ConvTranspose3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softmax, nn.LogSoftmax,
    nn.LayerNorm, nn.GroupNorm, nn.Embedding,
    ScaleObs, ImageStep, ResidualBlock, ActorCriticHeads,
)
"""Module types whose forward reads only its input and its parameters: no buffer it updates, no random draw.
Subclasses do not count (a subclass may add either), so the test is on the exact type."""

T = TypeVar("T")


def concurrent_safe(net: nn.Module) -> bool:
    """Whether ``net``'s forwards may run on several threads at once with the numbers they get one after another:
    every module in it is of a type in `_STATELESS` and holds no buffer."""
    return all(type(m) in _STATELESS and not any(True for _ in m.buffers(recurse=False)) for m in net.modules())


def add_in_order(params: Sequence[torch.Tensor], parts: Sequence[Sequence[torch.Tensor | None]]) -> None:
    """Each part's gradients (`torch.autograd.grad`'s, in ``params``' order) into ``params``' ``.grad``, part by
    part in the order given: the sums autograd leaves when the parts' backwards run in that order."""
    for i, p in enumerate(params):
        for grads in parts:
            g = grads[i]
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


_local = threading.local()


class PartWorkers:
    """``workers`` threads, each running its torch operations on ``threads`` intra-op threads, that record their
    work's spans on the process's timeline (`splitrl.schedule.common.Timeline`) as ``phase``."""

    def __init__(self, workers: int, threads: int) -> None:
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="parts",
                                        initializer=lambda: torch.set_num_threads(threads))

    def submit(self, phase: str, fn: Callable[..., T], *args: Any) -> "Future[T]":
        return self._pool.submit(_timed, phase, fn, *args)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


def _timed(phase: str, fn: Callable[..., T], *args: Any) -> T:
    clock = getattr(_local, "clock", None)
    if clock is None:  # a clock of each worker's own: a phase's start is kept on its clock
        clock = _local.clock = PhaseClock()
    with clock(phase):
        return fn(*args)


_lock = threading.Lock()
_shared: dict[int, PartWorkers] = {}
_configured = 0


def configure(workers: int) -> None:
    """This process's number of workers (``--part-workers``): 0 for the default, 1 for the parts in turn."""
    global _configured
    if workers < 0:
        raise ValueError(f"part workers must be >= 0, got {workers}")
    _configured = workers


def worker_count(threads: int, configured: int = 0, cores: int | None = None) -> int:
    """``configured`` workers (``--part-workers``), or where 0 the default: as many as ``cores`` (default: those this
    process may run on) hold ``threads`` intra-op threads each, at least two."""
    if configured:
        return configured
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, cores // max(1, threads))


def part_workers(*nets: nn.Module) -> PartWorkers | None:
    """This process's workers for the parts of a minibatch through ``nets`` (made on first use, with the calling
    thread's intra-op threads), or None where the parts go in turn: ``nets`` not `concurrent_safe`, or one
    worker (`configure`)."""
    if not all(concurrent_safe(net) for net in nets):
        return None
    threads = torch.get_num_threads()
    workers = worker_count(threads, _configured)
    if workers <= 1:
        return None
    with _lock:
        pool = _shared.get(threads)
        if pool is None or pool.workers != workers:
            if pool is not None:
                pool.close(wait=False)
            pool = _shared[threads] = PartWorkers(workers, threads)
        return pool
