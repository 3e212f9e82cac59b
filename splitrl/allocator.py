"""Keep the C allocator from handing big buffers back to the kernel between minibatches.

Training allocates and frees the same tensors every minibatch: a batch of observations as floats (19 MB at the
paper's shapes), the convolutions' activations and unfolded inputs (up to ~70 MB), their gradients. glibc's
malloc serves every request above its mmap threshold (128 KiB at first, rising only to what has been freed
before) with a fresh `mmap` and returns it with `munmap` when freed, and trims the top of its heap back to the
kernel once more than twice that threshold is free. Either way the next minibatch touches new pages: a minor page
fault and a zeroed page every 4 KiB, about 0.4 M faults for 24 minibatches of the paper's network, a sixth of the
training's CPU time (`python benchmarks/allocator.py`).

`keep_freed_memory` raises both thresholds for this process (glibc's ``mallopt``: ``M_MMAP_THRESHOLD`` 64 MiB,
``M_TRIM_THRESHOLD`` 128 MiB), so freed buffers are reused from the heap: the same computation, with the same
numbers, on pages already mapped. What it costs: up to the trim threshold of freed memory stays in the process,
reusable but counted in its resident size; allocations above 64 MiB (a rollout's observations) are mapped and
unmapped as before. Where a process knows it will not need what it freed again (a message dropped for its
size), `give_back_freed_memory` returns it at once. glibc's own `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` or `GLIBC_TUNABLES` in the
environment, or another allocator in `LD_PRELOAD`, win: then nothing is changed; `SPLITRL_ALLOCATOR=default`
leaves glibc's defaults as well.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "give_back_freed_memory", "keep_freed_memory"]

MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_OLD_GLIBC_MMAP_MAX = 32 << 20
"""glibc before 2.35 refuses an mmap threshold above half its largest heap (32 MiB on 64-bit)."""

_USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module's doc); True if they were set.

    Does nothing (False) off glibc, or where the environment already chose the allocator's settings. Called
    once by every `splitrl` command and by each env worker process; calling it again does nothing."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("SPLITRL_ALLOCATOR", "") == "default" or not sys.platform.startswith("linux"):
        return False
    if any(os.environ.get(name) for name in _USERS_OWN) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) or mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_MMAP_MAX)):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def give_back_freed_memory() -> None:
    """Return the free memory of every arena of this process to the kernel now (glibc's ``malloc_trim(0)``), where
    `keep_freed_memory` holds it; nothing elsewhere."""
    if _applied:
        _libc().malloc_trim(0)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)
