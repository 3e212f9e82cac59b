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
many as the cores this process may run on hold ``--threads`` threads each (with torch's default threads, one:
the parts in turn). The seconds a part's work takes count in its stage's ``time/encoder`` or ``time/heads``, as
compute; the stage's own thread meanwhile waits on the link or on the workers, and ``time/link`` counts a wait for
the peer during which this stage's workers compute.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch
from torch import nn

from ..devices import channels_last_input
from ..models.builtin import ResidualBlock
from ..models.heads import ActorCriticHeads
from ..models.layers import ImageStep, ScaleObs
from .common import PhaseClock

__all__ = ["PartWorkers", "Task", "configure", "part_workers", "worker_count", "concurrent_safe", "add_in_order"]

_STATELESS = (
    nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
    nn.ConvTranspose3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softmax, nn.LogSoftmax,
    nn.LayerNorm, nn.GroupNorm,
    ScaleObs, ImageStep, ResidualBlock, ActorCriticHeads,
)
"""Module types whose forward reads only its input and its parameters: no buffer it updates, no weight it
rewrites (an ``nn.Embedding`` with ``max_norm`` does), no random draw. Subclasses do not count (a subclass may add
any of these), so the test is on the exact type."""

T = TypeVar("T")


def concurrent_safe(net: nn.Module) -> bool:
    """Whether ``net``'s forwards may run on several threads at once with the numbers they get one after another:
    on the CPU, every module in it of a type in `_STATELESS`, holding no buffer and no forward hook but
    ``--channels-last``'s (which only lays its input out), and no global forward hook set (a hook may change the
    module it runs on)."""
    from torch.nn.modules import module as _module

    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    if any(p.device.type != "cpu" for p in net.parameters()):  # a GPU runs one part's kernels at a time anyway
        return False
    return all(type(m) in _STATELESS and not m._forward_hooks
               and all(hook is channels_last_input for hook in m._forward_pre_hooks.values())
               and not any(True for _ in m.buffers(recurse=False)) for m in net.modules())


def add_in_order(params: Sequence[torch.Tensor], parts: Sequence[Sequence[torch.Tensor | None]]) -> None:
    """Each part's gradients (`torch.autograd.grad`'s, in ``params``' order) into ``params``' ``.grad``, part by
    part in the order given: the sums autograd leaves when the parts' backwards run in that order (a gradient laid
    out otherwise than its parameter is copied into the parameter's layout first, as autograd does)."""
    for i, p in enumerate(params):
        for grads in parts:
            g = grads[i]
            if g is None:
                continue
            if p.grad is not None:
                p.grad.add_(g)
            elif g.stride() == p.stride():
                p.grad = g
            else:
                p.grad = torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)


class Task(Generic[T]):
    """A part's work on a worker: `result` gives its value and adds the seconds it took to the stage's clock (on
    the stage's own thread: a clock is not shared between threads)."""

    __slots__ = ("_future", "_clock", "_phase")

    def __init__(self, future: "Future[tuple[T, float]]", clock: PhaseClock, phase: str) -> None:
        self._future, self._clock, self._phase = future, clock, phase

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        """Until the work is done (its error, if any, is raised by `result`)."""
        self._future.exception()

    def result(self) -> T:
        value, seconds = self._future.result()
        self._clock.seconds[self._phase] += seconds
        return value


_local = threading.local()


class PartWorkers:
    """``workers`` threads, each running its torch operations on ``threads`` intra-op threads. Their work's
    seconds count in the submitting stage's clock under its phase, as that stage's compute; its spans go on the
    process's timeline (`splitrl.schedule.common.Timeline`) under the worker's thread."""

    def __init__(self, workers: int, threads: int) -> None:
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="parts",
                                        initializer=lambda: torch.set_num_threads(threads))

    def submit(self, clock: PhaseClock, phase: str, fn: Callable[..., T], *args: Any) -> Task[T]:
        return Task(self._pool.submit(_timed, phase, fn, *args), clock, phase)


def _timed(phase: str, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    # Each worker times its work on a clock of its own: a phase keeps its start on the clock it belongs to.
    clock = getattr(_local, "clock", None)
    if clock is None:
        clock = _local.clock = PhaseClock()
    before = clock.seconds[phase]
    with clock(phase):
        value = fn(*args)
    return value, clock.seconds[phase] - before


_lock = threading.Lock()
_shared: dict[tuple[int, int], PartWorkers] = {}
_configured = 0


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads: a pool it inherited would wait for workers that are not
    there."""
    global _lock
    _shared.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def configure(workers: int) -> None:
    """This process's number of workers (``--part-workers``): 0 for the default, 1 for the parts in turn."""
    global _configured
    if workers < 0:
        raise ValueError(f"part workers must be >= 0, got {workers}")
    _configured = workers


def worker_count(threads: int, configured: int = 0, cores: int | None = None) -> int:
    """``configured`` workers (``--part-workers``), or where 0 the default: as many as ``cores`` (default: those this
    process may run on) hold ``threads`` intra-op threads each (0: torch's default, every core), at least one."""
    if configured:
        return configured
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (threads if threads > 0 else cores))


def part_workers(*nets: nn.Module) -> PartWorkers | None:
    """This process's workers for the parts of a minibatch through ``nets`` (made on first use, with the calling
    thread's intra-op threads; the twin's two stages share them), or None where the parts go in turn: ``nets`` not
    `concurrent_safe`, or one worker (`configure`, `worker_count`)."""
    if not all(concurrent_safe(net) for net in nets):
        return None
    threads = torch.get_num_threads()
    workers = worker_count(threads, _configured)
    if workers <= 1:
        return None
    with _lock:
        pool = _shared.get((threads, workers))
        if pool is None:
            pool = _shared[threads, workers] = PartWorkers(workers, threads)
        return pool
