"""Who may drive the learner: CURVE keys, and no link beyond this machine without them unless asked."""

from __future__ import annotations

import stat
import subprocess

import pytest
import zmq
import zmq.auth
from click.testing import CliRunner

from splitrl.cli import main
from splitrl.launch import free_port_pair

from ..conftest import child_env, splitrl_cmd
from .conftest import OPTIONS, SETTINGS


@pytest.fixture
def keydir(tmp_path):
    result = CliRunner().invoke(main, ["keys", str(tmp_path / "keys")])
    assert result.exit_code == 0, result.output
    return tmp_path / "keys"


def test_keys_makes_the_documented_files_with_private_secrets(keydir):
    assert sorted(p.relative_to(keydir).as_posix() for p in keydir.rglob("*") if p.is_file()) == [
        "authorized/stage0.key", "stage0.key_secret", "stage1.key", "stage1.key_secret"]
    for secret in keydir.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    again = CliRunner().invoke(main, ["keys", str(keydir)])
    assert again.exit_code == 2 and "exists already" in again.output
    more = CliRunner().invoke(main, ["keys", str(keydir), "--name", "edge2"])
    assert more.exit_code == 0 and (keydir / "authorized" / "edge2.key").exists()


def _args(tmp_path, name, keydir=None):
    return ["--run-dir", str(tmp_path / name), *SETTINGS.to_argv(), *OPTIONS,
            *(["--curve", str(keydir)] if keydir else [])]


def test_an_unknown_key_is_refused_and_stage1_keeps_serving(spawn, keydir, tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    stage1 = spawn("stage1", "--bind", endpoint, *_args(tmp_path, "s1", keydir))
    stage1.wait_for("listening on", timeout=90)
    server_public, _ = zmq.auth.load_certificate(keydir / "stage1.key")
    ctx = zmq.Context()
    try:
        # A stranger with its own key pair, who knows the server's public key: refused by ZAP.
        public, secret = zmq.curve_keypair()
        stranger = ctx.socket(zmq.PUSH)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.curve_publickey, stranger.curve_secretkey, stranger.curve_serverkey = public, secret, server_public
        stranger.connect(endpoint)
        # ... and one speaking no CURVE at all, sending garbage.
        plain = ctx.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain.setsockopt(zmq.SNDTIMEO, 2000)
        plain.connect(endpoint)
        for sock in (stranger, plain):
            try:
                sock.send_multipart([b"\x00", b"not a message"], zmq.NOBLOCK)
            except zmq.Again:
                pass  # no connection came up: nothing could be queued
        stage1.wait_for(f"refused a peer whose CURVE key {public.decode()}", timeout=30)
        # The real stage0 still gets its session.
        stage0 = spawn("stage0", "--connect", endpoint, *_args(tmp_path, "s0", keydir))
        code0, out0 = stage0.finish(timeout=240)
        code1, out1 = stage1.finish(timeout=60)
        assert code0 == 0, out0
        assert code1 == 0, out1
        assert "invalid" not in out1.lower() and "ProtocolError" not in out1
        stranger.close()
        plain.close()
    finally:
        ctx.term()


@pytest.mark.parametrize("impostor, pinned", [("plain", True), ("plain", False), ("curve", True)])
def test_stage0_talks_only_to_the_server_key_it_pins(spawn, raw_peers, keydir, tmp_path, impostor, pinned):
    """An impostor stage1 in stage0's place: one speaking no CURVE (the control: a stage0 without --curve gives
    it its hello, so the impostor would hear a stage0 that did not pin) or one with a CURVE key of its own. A
    stage0 that pins stage1's key sends neither a byte of its hello and says it heard nothing."""
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    curve = None
    if impostor == "curve":
        public, secret = zmq.curve_keypair()
        curve = {"CURVE_SERVER": 1, "CURVE_PUBLICKEY": public, "CURVE_SECRETKEY": secret}
    # Longer than stage0's --start-timeout; the control waits for a stage0 that may be slow to start (a busy CI).
    peer = raw_peers(endpoint, bind=True, timeout=8 if pinned else 120, curve=curve)
    stage0 = spawn("stage0", "--connect", endpoint, *_args(tmp_path, "s0", keydir if pinned else None),
                   "--start-timeout", "5")
    if not pinned:
        kind, header, _ = peer.recv()
        assert kind == "hello" and header["role"] == "stage0"
        stage0.finish(timeout=120)  # (no answer: it gives up after its --start-timeout)
        return
    with pytest.raises(zmq.Again):
        peer.recv()
    code, out = stage0.finish(timeout=120)
    assert code == 1, out
    # Its hello waits for a connection that never completes: queued (then nothing comes back) or, where ZeroMQ
    # has no pipe for it yet, not sent within the --start-timeout. Either way not a byte reached the impostor.
    assert "no message from stage1" in out or "could not send to stage1" in out, out


@pytest.mark.parametrize("command, endpoint_option, extra", [
    ("stage1", "--bind", []), ("stage0", "--connect", []), ("stage1", "--bind", ["--transport", "tcp"])])
def test_a_link_beyond_this_machine_needs_curve_or_insecure(tmp_path, command, endpoint_option, extra):
    endpoint = f"tcp://0.0.0.0:{free_port_pair()}" if command == "stage1" else "tcp://192.0.2.1:5555"
    result = subprocess.run(splitrl_cmd(command, endpoint_option, endpoint, *_args(tmp_path, "r"), *extra),
                            env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--curve" in result.stderr and "--insecure" in result.stderr
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_insecure_binds_everywhere_with_a_warning(spawn, tmp_path):
    endpoint = f"tcp://0.0.0.0:{free_port_pair()}"
    stage1 = spawn("stage1", "--bind", endpoint, *_args(tmp_path, "s1"), "--insecure")
    stage1.wait_for("listening on", timeout=90)
    assert "--insecure: binding" in stage1.output() and "without CURVE" in stage1.output()


def test_curve_needs_the_zmq_transport(tmp_path, keydir):
    result = subprocess.run(splitrl_cmd("stage1", *_args(tmp_path, "s1", keydir), "--transport", "tcp"),
                            env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--curve needs --transport zmq" in result.stderr
