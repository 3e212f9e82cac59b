"""The allocator's thresholds: freed buffers reused without new page faults, and the user's own settings kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

_CHURN = textwrap.dedent("""
    import json, resource, sys
    import torch
    from splitrl.allocator import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else False
    for _ in range(12):  # the heap's own warm-up: torch asks for aligned blocks, a little more than one freed
        torch.ones(10 << 20)  # 40 MiB of float32, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # what a minibatch does: the same big buffers allocated, filled and freed again
        torch.ones(10 << 20)
    print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
""")


def _churn(mode: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "SPLITRL_ALLOCATOR"}
    out = subprocess.run([sys.executable, "-c", _CHURN, mode], env={**environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_freed_buffers_are_reused_without_touching_new_pages():
    """Torch's tensors (numpy asks for huge pages, torch does not by default). 40 MiB is 10,240 pages, above the highest mmap threshold glibc's defaults ever reach (32 MiB): they map and
    unmap it each time (~10,000 faults a round); kept, the heap serves it again from pages already there."""
    default, kept = _churn("default"), _churn("keep")
    assert kept["kept"] and not default["kept"]
    assert default["faults"] > 20 * 8000, default
    assert kept["faults"] < 1000, kept


@pytest.mark.parametrize("env", [{"SPLITRL_ALLOCATOR": "default"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}])
def test_the_users_own_allocator_settings_win(env):
    r = _churn("keep", **env)
    assert not r["kept"], r
    assert r["faults"] > 20 * 8000, r  # glibc's way, as the user asked


def test_every_command_keeps_freed_memory():
    """The group's callback runs before any command: `splitrl --version` never does (click answers it earlier),
    so look at a command that does nothing else."""
    code = ("import sys; from splitrl.cli import main; from splitrl import allocator\n"
            "try:\n    main(['codecs'], standalone_mode=False)\nfinally:\n    print('KEPT', allocator._applied)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "SPLITRL_ALLOCATOR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "KEPT True" in out, out
