"""Third parties cannot break a session: their messages are dropped and counted, their connections refused.

The hostile sides here use only pyzmq / sockets, msgpack and the byte layout of docs/PROTOCOL.md.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from splitrl.transport import TcpTransport, TransportTimeout
from splitrl.transport import tcp_transport

from .conftest import OPTIONS, SETTINGS
from .peer import settings_hash
from .test_values import FEATURES, _stage1


def test_messages_of_another_session_are_dropped_and_the_session_goes_on(spawn, raw_peers, endpoint, tmp_path):
    stage1 = _stage1(spawn, endpoint, tmp_path)
    peer = raw_peers(endpoint, bind=False)
    peer.hello("stage0", SETTINGS.shared())
    kind, _, _ = peer.recv()
    assert kind == "hello" and peer.sid is not None
    features = np.zeros((1, FEATURES), dtype=np.float32)
    session = peer.sid
    for stranger in (None, session ^ 1):  # no session id, another session's
        peer.sid = stranger
        peer.seq = 1
        peer.send("step", {"t": 0}, [("features", features)])
    peer.sid, peer.seq = session, 1
    peer.send("step", {"t": 0}, [("features", features)])
    kind, header, tensors = peer.recv()  # answered: the strangers' steps did not end or confuse the session
    assert (kind, header["t"]) == ("action", 0) and tensors["action"].shape == (1, 3)
    peer.send("abort", {"reason": "test over"})
    code, out = stage1.finish(timeout=60)
    assert code == 1 and "test over" in out
    assert "not this session's (1 so far)" in out and "(2 so far)" in out


def _refusal(sock: socket.socket) -> dict:
    """Read one message in the plain TCP framing (section 10) and return its outer msgpack header."""
    sock.settimeout(10)
    data = b""
    while len(data) < 12:
        data += sock.recv(4096)
    count, length = struct.unpack_from("<IQ", data)
    assert count == 1
    while len(data) < 12 + length:
        data += sock.recv(4096)
    return msgpack.unpackb(data[12:12 + length])


def _hello(link: TcpTransport) -> None:
    link.send("hello", header={"proto": 1, "role": "stage0"})


def test_a_silent_connection_does_not_hold_the_tcp_binders_place():
    server = TcpTransport("tcp://127.0.0.1:0", bind=True, timeout=10, heartbeat=0.5)  # opening window: 1 s
    host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))  # first in, never says a word
    real = TcpTransport(server.endpoint, bind=False, timeout=10)
    try:
        threading.Thread(target=_hello, args=(real,), daemon=True).start()
        msg = server.recv_opening("hello", timeout=10)  # before: the silent one held it until this timed out
        assert msg.kind == "hello" and server.strangers == 1
    finally:
        silent.close()
        real.close()
        server.close()


def test_a_second_tcp_connection_is_refused_while_the_session_goes_on():
    server = TcpTransport("tcp://127.0.0.1:0", bind=True, timeout=10, heartbeat=2)
    client = TcpTransport(server.endpoint, bind=False, timeout=10)
    host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    try:
        client.send("hello", header={"proto": 1})
        server.recv_opening("hello")
        server.session = client.session = 7
        intruder = socket.create_connection((host, int(port)))
        refusal = _refusal(intruder)
        assert refusal["k"] == "abort" and "one session at a time" in refusal["h"]["reason"]
        assert intruder.recv(1) == b""  # and closed
        intruder.close()
        client.send("step", header={"t": 0})
        assert server.recv().header == {"t": 0}
        assert server.refused == 1
    finally:
        client.close()
        server.close()


def test_a_long_tcp_wait_says_what_it_waits_for(monkeypatch, caplog):
    monkeypatch.setattr(tcp_transport, "WAITING_LINE_EVERY", 0.2)
    server = TcpTransport("tcp://127.0.0.1:0", bind=True, timeout=10)
    try:
        with caplog.at_level("INFO", logger="splitrl.transport.tcp_transport"):
            with pytest.raises(TransportTimeout):
                server.recv(timeout=0.7)
        lines = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
        assert lines and "to connect to" in lines[0] and "giving up after 1 s" in lines[0], lines
    finally:
        server.close()


def test_a_stage1_that_loses_its_stage0_mid_run_waits_for_it_with_rejoin(spawn, raw_peers, endpoint, tmp_path):
    """--rejoin: a stage0 that comes back without --resume is told how to rejoin, leaves, and stage1 keeps
    waiting; one that resumes is taken."""
    stage1 = spawn("stage1", "--bind", endpoint, "--run-dir", str(tmp_path / "s1"), *SETTINGS.to_argv(),
                   *OPTIONS, "--heartbeat", "1", "--rejoin", "30")
    first = raw_peers(endpoint, bind=False)
    first.hello("stage0", SETTINGS.shared())
    assert first.recv()[0] == "hello"
    first.close()  # gone mid-run: its connections close
    stage1.wait_for("waiting up to 30 s for stage0 to rejoin", timeout=30)
    second = raw_peers(endpoint, bind=False)
    second.hello("stage0", SETTINGS.shared())  # no checkpoints: not a resumed stage0
    assert second.recv()[0] == "hello"  # stage1 answers before it checks (section 7)
    kind, header, _ = second.recv()
    assert kind == "abort" and "--resume" in header["reason"]
    stage1.wait_for("still waiting", timeout=30)
    second.close()  # it leaves, as a refused stage0 does
    time.sleep(2)  # more than the heartbeat's grace: its going is not stage1's end
    assert stage1.popen.poll() is None, stage1.output()
    third = raw_peers(endpoint, bind=False)
    third.send("hello", {"proto": 1, "role": "stage0", "settings_hash": settings_hash(SETTINGS.shared()),
                         "settings": SETTINGS.shared(), "checkpoints": []})  # resumes: no checkpoint in common
    kind, header, _ = third.recv()
    assert kind == "hello" and header.get("checkpoints") == [] and third.sid is not None
    stage1.wait_for("resuming after iteration 0", timeout=30)


@pytest.mark.parametrize("hello", ["other settings", "stage1's role", "another protocol version"])
def test_a_waiting_stage1_survives_a_strangers_wrong_hello_and_serves_its_stage0(spawn, raw_peers, endpoint, tmp_path,
                                                                                hello):
    """Before a session, a hello that fails (other settings, the wrong role, another protocol version) is a
    stranger's: stage1 answers it, says so once, and keeps waiting for the stage0 it serves, which then trains
    to the end."""
    stage1 = _stage1(spawn, endpoint, tmp_path)
    stranger = raw_peers(endpoint, bind=False)
    if hello == "other settings":
        stranger.hello("stage0", {**SETTINGS.shared(), "seed": 99})
    elif hello == "stage1's role":
        stranger.hello("stage1", SETTINGS.shared())
    else:
        stranger.send("hello", {"proto": 2, "role": "stage0", "settings_hash": settings_hash(SETTINGS.shared()),
                                "settings": SETTINGS.shared()})
    kind, _, _ = stranger.recv()  # stage1's answer: the stranger learns why before it goes
    assert kind == "hello"
    stranger.close()
    stage1.wait_for("refused a peer whose hello failed", timeout=30)
    assert stage1.popen.poll() is None  # before: stage1 exited 1 here
    stage0 = spawn("stage0", "--connect", endpoint, "--run-dir", str(tmp_path / "s0"), *SETTINGS.to_argv(), *OPTIONS)
    code, out = stage0.finish(timeout=180)
    assert code == 0, out
    code, out = stage1.finish(timeout=60)
    assert code == 0, out
    assert out.count("refused a peer whose hello failed") == 1
