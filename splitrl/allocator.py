"""Keep the C allocator from handing big buffers back to the kernel between minibatches.

Training allocates and frees the same tensors every minibatch: a batch of observations as floats (19 MB at the
paper's shapes), the convolutions' activations and unfolded inputs (up to ~70 MB), their gradients. glibc's
malloc serves every request above its mmap threshold (128 KiB at first, rising only to the size of what has been
freed before, at most 32 MiB) with a fresh `mmap` and returns it with `munmap` when freed, and trims the top of a
heap back to the kernel once more than twice that threshold is free there. Either way the next minibatch touches
new pages: a minor page fault and a zeroed page every 4 KiB, millions an iteration
(`python benchmarks/allocator.py`, docs/benchmarks/floor.md).

`keep_freed_memory` raises both thresholds for this process (glibc's ``mallopt``: ``M_MMAP_THRESHOLD`` 64 MiB, or
32 MiB where glibc older than 2.35 refuses more; ``M_TRIM_THRESHOLD`` 128 MiB), so freed buffers are reused from
the heap: the same computation, with the same numbers, on pages already mapped. What it costs: freed memory stays
in the process, reusable but counted in its resident size: up to the trim threshold at the top of the main heap,
and whatever the heaps of other threads' arenas (64 MiB each at most) hold free. Allocations above the mmap
threshold (a rollout's observations) are mapped and unmapped as before. Where a process knows it will not need
what it frees (a message dropped for its size), it frees it within `giving_back`, which returns it at once.

glibc's own ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``glibc.malloc``
tunables in the environment, or anything in ``LD_PRELOAD`` (another allocator, most likely), win: then nothing
is changed; ``SPLITRL_ALLOCATOR=default`` leaves glibc's defaults as well.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Mapping

__all__ = ["ALLOCATOR_ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "applied_mmap_threshold", "giving_back",
           "keep_freed_memory", "without_allocator_settings"]

log = logging.getLogger(__name__)

ALLOCATOR_ENV = "SPLITRL_ALLOCATOR"
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_OLD_GLIBC_MMAP_MAX = 32 << 20
"""glibc before 2.35 refuses an mmap threshold above half its largest heap (32 MiB on 64-bit)."""

_USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")
_GIVING_BACK_TRIM = 128 << 10
"""glibc's initial trim threshold, what `giving_back` lowers it to."""
_TRIM_EVERY_S = 1.0
"""`giving_back` trims at most this often: a peer that has its messages dropped over and over cannot
make the stage walk its heaps for each."""

_applied: int | None = None
"""The mmap threshold set (0: none), once `keep_freed_memory` has run."""
_last_trim = -_TRIM_EVERY_S


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module's doc); True if they were set.

    Does nothing (False) off glibc, or where the environment already chose the allocator's settings. Called
    once by every `splitrl` command and by each env worker process; calling it again does nothing."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied > 0


def applied_mmap_threshold() -> int:
    """The mmap threshold `keep_freed_memory` set in this process (0: it set none, or has not run)."""
    return _applied or 0


def without_allocator_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less every variable that keeps `keep_freed_memory` from acting: a child started with it gets
    glibc's defaults unless it calls `keep_freed_memory`."""
    return {k: v for k, v in environ.items()
            if not k.startswith("MALLOC_") and k not in (ALLOCATOR_ENV, "LD_PRELOAD", "GLIBC_TUNABLES")}


def _apply() -> int:
    if os.environ.get(ALLOCATOR_ENV, "") == "default" or not sys.platform.startswith("linux"):
        return 0
    chosen = [name for name in _USERS_OWN if os.environ.get(name)]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        log.debug("malloc's thresholds left as they are: %s set", ", ".join(chosen))
        return 0
    libc = _libc()
    if libc is None:
        log.debug("malloc's thresholds left as they are: not glibc")
        return 0
    for threshold in (MMAP_THRESHOLD, _OLD_GLIBC_MMAP_MAX):
        if libc.mallopt(_M_MMAP_THRESHOLD, threshold):
            return threshold if libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) else 0
    return 0


@contextmanager
def giving_back() -> Iterator[None]:
    """What is freed within the block goes back to the kernel (glibc's trim threshold lowered meanwhile, then
    ``malloc_trim(0)``), where `keep_freed_memory` holds freed memory, and at most once a second; elsewhere the
    block just runs. For what a process knows it will not need again: a message dropped for its size.

    The threshold is lowered while the memory is freed, not only trimmed after: ``malloc_trim`` releases the
    free blocks inside a heap but not the free top of another thread's arena (libzmq's I/O thread allocates a
    message's parts), which glibc gives back only as a block is freed above its trim threshold."""
    global _last_trim
    now = time.monotonic()
    libc = _libc()
    if not _applied or libc is None or now - _last_trim < _TRIM_EVERY_S:
        yield
        return
    _last_trim = now
    libc.mallopt(_M_TRIM_THRESHOLD, _GIVING_BACK_TRIM)
    try:
        yield
    finally:
        libc.malloc_trim(0)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """This process's C library with ``mallopt`` and ``malloc_trim`` typed, or None if it has not both (musl)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc
