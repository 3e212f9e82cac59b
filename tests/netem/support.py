"""Helpers and fixtures for tests that need root and working ``ip netns`` (netem and the lab's benchmarks).

Fixtures defined here are made visible by importing them in a conftest.py.
"""

import contextlib
import fcntl
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

__all__ = ["ip_netns_list", "netns_usable", "remove_namespaces", "netns_exclusive", "netns_ok", "netns_module",
           "needs_netns", "no_leftovers"]

_LOCK = os.path.join(tempfile.gettempdir(), "splitrl-tests-netns.lock")
LOCK_WAIT = 900
"""Seconds to wait for the other worker's namespace tests (the longest module takes about two minutes)."""
_held: list[int] = []  # the lock file's descriptor while this process holds it, once per nesting level


@contextlib.contextmanager
def netns_exclusive():
    """Hold the machine-wide lock on making network namespaces (reentrant within a process).

    Namespaces belong to the machine, not to a test: `make test` runs several workers, and a test that checks
    that no ``splitrl-`` namespace is left must not see another worker's. Every test module that makes
    namespaces holds this while it runs (`netns_module`), and so does the probe (`netns_ok`)."""
    if not _held:
        # Read-only if another user made the file (sticky /tmp refuses O_TRUNC on it); flock works either way.
        try:
            fd = os.open(_LOCK, os.O_RDONLY | os.O_CREAT, 0o666)
        except PermissionError:
            fd = os.open(_LOCK, os.O_RDONLY)
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # closing the file releases it
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(f"{_LOCK}: held by another test process for {LOCK_WAIT} s (a stray "
                                       "process of an earlier run? `fuser` names it)") from None
                time.sleep(0.1)
        _held.append(fd)
    else:
        _held.append(_held[-1])
    try:
        yield
    finally:
        fd = _held.pop()
        if not _held:
            os.close(fd)


def ip_netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=15).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_usable() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs ip and tc (iproute2)"
    probe = f"splitrl-probe-{secrets.token_hex(3)}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=15)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=15)
    return None


def remove_namespaces(namespaces) -> None:
    for ns in namespaces:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=15)


@pytest.fixture(scope="session")
def netns_ok():
    """Skip unless this process can create network namespaces (probed once, in a throwaway one)."""
    with netns_exclusive():
        why_not = netns_usable() if sys.platform.startswith("linux") else "Linux only"
    if why_not is not None:
        pytest.skip(f"lab tests: {why_not}")


needs_netns = pytest.mark.usefixtures("netns_ok")


@pytest.fixture(scope="module")
def netns_module():
    """`netns_exclusive` for a whole module (its module-scoped labs too: make them depend on this)."""
    with netns_exclusive():
        yield


@pytest.fixture
def no_leftovers(netns_ok):
    """Remove this test's namespaces whatever happens, then check none is left."""
    made: list[str] = []
    yield made
    remove_namespaces(made)
    assert not [ns for ns in ip_netns_list() if ns.startswith("splitrl-")]
