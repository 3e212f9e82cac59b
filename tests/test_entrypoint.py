"""docker/entrypoint.sh without a docker engine: a fleet's places claimed, renewed, released and taken over,
and the keys shared out so that each container holds only its own secret. The script is sourced as a library
(it runs nothing then) and its functions are driven with bash, as compose's containers would."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from splitrl.transport.curve import client_keys, server_keys

from .conftest import ROOT, child_env

ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**child_env(), "CLAIMS_DIR": str(tmp_path / "claims"), "CLAIM_WAIT": "0", **extra}


def _bash(tmp_path: Path, script: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"source {ENTRYPOINT}\n{script}"], env=_env(tmp_path, **extra),
                          capture_output=True, text=True, timeout=60)


def _claims(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "claims").iterdir())


def _start(tmp_path: Path, command: str, **extra: str) -> subprocess.Popen:
    """A "container": claims a place of 2 and runs ``command`` holding it, as the entrypoint does."""
    script = f'source {ENTRYPOINT}\nclaim_place 2 || exit 9\ntrap release_place EXIT\necho "place $place"\n' \
             f"run_holding {command}"
    proc = subprocess.Popen(["bash", "-c", script], env=_env(tmp_path, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    assert line.startswith("place "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=20)


def test_each_place_is_claimed_once_and_is_free_again_once_released(tmp_path):
    out = _bash(tmp_path, """
        claim_place 2; echo "first $place"; first=$claim first_token=$claim_token
        claim_place 2; echo "second $place"
        claim_place 2 || echo "third: none"
        claim=$first claim_token=$first_token; release_place
        claim_place 2; echo "again $place"
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["first 0", "second 1", "third: none", "again 0"]


def test_a_claim_not_renewed_for_a_lease_is_taken_over_and_its_old_holder_cannot_release_it(tmp_path):
    out = _bash(tmp_path, """
        claim_place 1; old=$claim old_token=$claim_token
        claim_place 1 || echo "fresh: kept"
        touch -d '-10 seconds' "$old/holder"
        claim_place 1 && echo "stale: taken over, place $place"
        mine=$claim_token
        claim=$old claim_token=$old_token; release_place
        [[ "$(cat "$old/holder")" == "$mine" ]] && echo "the new holder keeps it"
    """, CLAIM_LEASE="5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["fresh: kept", "stale: taken over, place 0", "the new holder keeps it"]
    assert "was not renewed for 5 s: taking it over" in out.stderr
    assert _claims(tmp_path) == ["edge0"]


def test_the_claim_is_released_when_the_command_ends_with_its_status(tmp_path):
    out = _bash(tmp_path, 'claim_place 2; echo "place $place"; run_holding sh -c "exit 3"')
    assert out.returncode == 3, out.stderr
    assert out.stdout.startswith("place 0")
    assert _claims(tmp_path) == []


def test_a_running_edge_renews_its_claim_and_a_stopped_one_releases_it(tmp_path):
    edge = _start(tmp_path, "sleep 60", CLAIM_LEASE="4")
    try:
        holder = tmp_path / "claims" / "edge0" / "holder"
        old = time.time() - 100
        os.utime(holder, (old, old))
        deadline = time.time() + 10
        while holder.stat().st_mtime < old + 50 and time.time() < deadline:
            time.sleep(0.2)
        assert holder.stat().st_mtime > old + 50, "the claim was not renewed"
        edge.send_signal(signal.SIGTERM)  # docker stop / compose down: passed on to the command
        assert edge.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        _kill(edge)
    assert _claims(tmp_path) == []


def test_up_after_down_finds_the_places_free(tmp_path):
    edges: list[subprocess.Popen] = []
    try:
        edges += [_start(tmp_path, "sleep 60", CLAIM_LEASE="2") for _ in range(2)]
        assert _claims(tmp_path) == ["edge0", "edge1"]
        # `down`: one container stopped (its trap releases the claim), one killed outright (no trap runs).
        edges[0].send_signal(signal.SIGTERM)
        edges[0].wait(timeout=20)
        os.killpg(edges[1].pid, signal.SIGKILL)  # every process of the "container"
        edges[1].wait(timeout=20)
        assert _claims(tmp_path) == ["edge1"]
        # `up` again: both places are found, the killed one's once its claim's lease has run out.
        edges += [_start(tmp_path, "sleep 60", CLAIM_LEASE="2", CLAIM_WAIT="20") for _ in range(2)]
        assert _claims(tmp_path) == ["edge0", "edge1"]
        for edge in edges[2:]:
            edge.send_signal(signal.SIGTERM)
            assert edge.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        for edge in edges:
            _kill(edge)
    assert _claims(tmp_path) == []


@pytest.fixture
def shared(tmp_path):
    """A world-traversable directory (the edges' uids must reach their keys) and a `splitrl` on PATH."""
    top = Path(tempfile.mkdtemp(prefix="splitrl-keys-"))
    top.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "splitrl").write_text(f'#!/bin/sh\nexec {sys.executable} -m splitrl "$@"\n')
    (bin_dir / "splitrl").chmod(0o755)
    for name in ("vault", "stage1-keys", "edge-keys"):
        (top / name).mkdir()
    try:
        yield top, f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    finally:
        shutil.rmtree(top)


def _share(tmp_path, top: Path, path: str, edges: int) -> None:
    result = subprocess.run(["bash", str(ENTRYPOINT), "share-keys", str(top / "vault"), str(top / "stage1-keys"),
                             str(top / "edge-keys")], env=_env(tmp_path, PATH=path, EDGES=str(edges)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def _files(directory: Path) -> dict[str, int]:
    return {p.relative_to(directory).as_posix(): stat.S_IMODE(p.stat().st_mode)
            for p in directory.rglob("*") if p.is_file()}


def test_each_container_gets_only_its_own_secret(tmp_path, shared):
    top, path = shared
    _share(tmp_path, top, path, 3)
    assert _files(top / "stage1-keys") == {
        "stage1.key_secret": 0o600, "stage1.key": 0o644, "authorized/stage0.key": 0o644,
        "authorized/edge0.key": 0o644, "authorized/edge1.key": 0o644, "authorized/edge2.key": 0o644}
    assert _files(top / "edge-keys") == {
        "stage1.key": 0o644, "edge0.key_secret": 0o600, "edge1.key_secret": 0o600, "edge2.key_secret": 0o600}
    if os.geteuid() == 0:  # each fleet edge's secret is its own uid's
        for k in range(3):
            assert (top / "edge-keys" / f"edge{k}.key_secret").stat().st_uid == 10000 + k
    server = server_keys(top / "stage1-keys")
    for k in range(3):
        edge = client_keys(top / "edge-keys", f"edge{k}")
        assert edge.server_public == server.public and edge.public in server.authorized

    # One edge after a fleet (`up` again without -v): the same keys, and no fleet edge's secret left behind.
    _share(tmp_path, top, path, 1)
    assert _files(top / "edge-keys") == {"stage1.key": 0o644, "stage0.key_secret": 0o600}
    assert client_keys(top / "edge-keys").server_public == server.public
    assert server_keys(top / "stage1-keys") == server


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_a_fleet_edges_uid_reads_its_own_secret_and_no_other(tmp_path, shared):
    top, path = shared
    _share(tmp_path, top, path, 2)

    def read_as(uid: int, name: str) -> int:
        return subprocess.run(["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups",
                               "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
                               "cat", str(top / "edge-keys" / name)], capture_output=True, timeout=30).returncode

    assert read_as(10001, "edge1.key_secret") == 0 and read_as(10001, "stage1.key") == 0
    assert read_as(10001, "edge0.key_secret") != 0
    assert read_as(10000, "edge0.key_secret") == 0 and read_as(10000, "edge1.key_secret") != 0
