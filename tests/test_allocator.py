"""The allocator's thresholds: freed buffers reused without new page faults, and the user's own settings kept."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from splitrl.allocator import without_allocator_settings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")

_CHURN = textwrap.dedent("""
    import json, resource, sys
    import torch
    from splitrl.allocator import applied_mmap_threshold, keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else False
    for _ in range(12):  # the heap's own warm-up: freed blocks merge until one fits torch's aligned request
        torch.ones(10 << 20)  # 40 MiB of float32, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # what a minibatch does: the same big buffers allocated, filled and freed again
        torch.ones(10 << 20)
    print(json.dumps({"kept": kept, "threshold": applied_mmap_threshold(),
                      "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
""")


def _huge_pages_always() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


def _churn(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHURN, mode], env={**without_allocator_settings(os.environ), **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(_huge_pages_always(), reason="the kernel backs every big mapping with 2 MiB pages: few faults")
def test_freed_buffers_are_reused_without_touching_new_pages():
    """Torch's tensors (numpy asks for huge pages, torch does not by default). 40 MiB is 10,240 pages, above the
    highest mmap threshold glibc's defaults ever reach (32 MiB): they map and unmap it each time (~10,000 faults a
    round); kept, the heap serves it again from pages already there."""
    default, kept = _churn("default"), _churn("keep")
    assert kept["kept"] and not default["kept"]
    assert default["faults"] > 20 * 8000, default
    if kept["threshold"] <= 40 << 20:
        pytest.skip("a glibc older than 2.35 maps 40 MiB buffers anyway (its mmap threshold stops at 32 MiB)")
    assert kept["faults"] < 1000, kept


@pytest.mark.skipif(_huge_pages_always(), reason="the kernel backs every big mapping with 2 MiB pages: few faults")
@pytest.mark.parametrize("env", [{"SPLITRL_ALLOCATOR": "default"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}])
def test_the_users_own_allocator_settings_win(env):
    r = _churn("keep", **env)
    assert not r["kept"] and r["threshold"] == 0, r
    assert r["faults"] > 20 * 8000, r  # glibc's way, as the user asked


def test_every_command_keeps_freed_memory():
    """The group's callback runs before any command: `splitrl --version` never does (click answers it earlier),
    so look at a command that does nothing else."""
    code = ("from splitrl.cli import main; from splitrl.allocator import applied_mmap_threshold\n"
            "try:\n    main(['codecs'], standalone_mode=False)\nfinally:\n    print('THRESHOLD', applied_mmap_threshold())")
    out = subprocess.run([sys.executable, "-c", code], env=without_allocator_settings(os.environ), capture_output=True,
                         text=True, timeout=120).stdout
    assert "THRESHOLD 67108864" in out or "THRESHOLD 33554432" in out, out


def test_a_dropped_message_is_given_back_at_most_once_a_second(monkeypatch):
    from splitrl import allocator

    calls = []

    class Libc:
        def malloc_trim(self, pad: int) -> int:
            calls.append(("trim", pad))
            return 1

        def mallopt(self, what: int, value: int) -> int:
            calls.append(("mallopt", what, value))
            return 1

    monkeypatch.setattr(allocator, "_applied", 64 << 20)
    monkeypatch.setattr(allocator, "_libc", Libc)
    monkeypatch.setattr(allocator, "_last_trim", -10.0)
    with allocator.giving_back():
        calls.append("freed")
    lowered, trimmed = ("mallopt", -1, 128 << 10), ("mallopt", -1, allocator.TRIM_THRESHOLD)
    assert calls == [lowered, "freed", ("trim", 0), trimmed]  # lowered while freeing, then trimmed and restored
    with allocator.giving_back():  # at once again: the block runs, nothing else
        calls.append("again")
    assert calls[4:] == ["again"]
    monkeypatch.setattr(allocator, "_applied", 0)
    monkeypatch.setattr(allocator, "_last_trim", -10.0)
    with allocator.giving_back():  # glibc's defaults: nothing held, nothing to give back
        calls.append("default")
    assert calls[5:] == ["default"]
