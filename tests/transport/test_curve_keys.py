"""CURVE key files: secrets created private (never readable by others, whatever the umask), and a secret whose
mode lets others at it refused when loaded, as SSH refuses a private key with loose modes."""

from __future__ import annotations

import os
import stat

import pytest
import zmq
import zmq.auth

from splitrl.errors import SettingsError
from splitrl.transport.curve import client_keys, make_keys, server_keys


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def no_umask():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_a_new_secret_is_created_0600_whatever_the_umask_and_never_chmodded(tmp_path, no_umask, monkeypatch):
    # With umask 0 a file opened with 0666 would be world-readable; and no chmod may narrow it afterwards.
    def refuse(*args, **kwargs):
        raise AssertionError("a secret's mode must be right when the file is created, not changed after")

    monkeypatch.setattr(os, "chmod", refuse)
    monkeypatch.setattr(os, "fchmod", refuse)
    written = make_keys(tmp_path, "edge1")
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        "stage1.key", "stage1.key_secret", "authorized/edge1.key", "edge1.key_secret"]
    for secret in tmp_path.glob("*.key_secret"):
        assert _mode(secret) == 0o600
    for public in [tmp_path / "stage1.key", tmp_path / "authorized" / "edge1.key"]:
        assert _mode(public) & 0o077 == 0o044  # public keys may be read by anyone


def test_the_files_are_pyzmqs_certificates_and_hold_matching_keys(tmp_path):
    make_keys(tmp_path, "stage0")
    for name, public_file in [("stage1", tmp_path / "stage1.key"), ("stage0", tmp_path / "authorized" / "stage0.key")]:
        public, secret = zmq.auth.load_certificate(tmp_path / f"{name}.key_secret")
        assert secret is not None and zmq.curve_public(secret) == public
        assert zmq.auth.load_certificate(public_file) == (public, None)
    server, client = server_keys(tmp_path), client_keys(tmp_path)
    assert client.server_public == server.public and client.public in server.authorized


def test_an_existing_secret_is_never_overwritten(tmp_path):
    make_keys(tmp_path, "edge1")
    before = (tmp_path / "edge1.key_secret").read_bytes()
    with pytest.raises(SettingsError, match="edge1.key_secret exists already"):
        make_keys(tmp_path, "edge1")
    assert (tmp_path / "edge1.key_secret").read_bytes() == before


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o601])
@pytest.mark.parametrize("secret, load", [("stage1", lambda d: server_keys(d)), ("stage0", lambda d: client_keys(d))])
def test_a_secret_others_may_open_is_refused_naming_the_file_and_the_fix(tmp_path, mode, secret, load):
    make_keys(tmp_path)
    path = tmp_path / f"{secret}.key_secret"
    os.chmod(path, mode)
    with pytest.raises(SettingsError) as refused:
        load(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert str(path) in message and f"chmod 600 {path}" in message and f"{mode:04o}" in message
    os.chmod(path, 0o600)
    load(tmp_path)  # fixed as told: loads


def test_public_keys_may_be_world_readable(tmp_path):
    make_keys(tmp_path)
    for public in [tmp_path / "stage1.key", tmp_path / "authorized" / "stage0.key"]:
        os.chmod(public, 0o644)
    server_keys(tmp_path)
    client_keys(tmp_path)

