"""ZmqTransport over tcp, ipc and inproc: round trips, timeouts, garbage, sequence
numbers, byte meters, abort and the handshake.

Every receive has a timeout of at most 5 s and every socket is closed in a fixture
or a ``finally``, so no test can hang or leak a socket into the next one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import torch
import zmq

from splitrl.transport import (
    PeerAbort,
    PeerGone,
    ProtocolError,
    TransportClosed,
    TransportTimeout,
    WireLimits,
    ZmqTransport,
    encode,
    paired_endpoint,
)
from splitrl.transport.base import INVALID_KIND
from splitrl.transport.handshake import HandshakeError, answer_hello, handshake, settings_hash
from splitrl.transport.gate import BUSY, _Slot
from splitrl.transport.wire import frame_nbytes

T = 5.0
"""Longest any receive in this file may wait."""

_names = itertools.count()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes any socket a failing test left open


@pytest.fixture
def make(ctx):
    """``make(endpoint, bind=..., **kw)`` -> a ZmqTransport closed at teardown."""
    made: list[ZmqTransport] = []

    def _make(endpoint: str, *, bind: bool, **kw) -> ZmqTransport:
        kw.setdefault("timeout", T)
        kw.setdefault("linger", 0.0)
        t = ZmqTransport(endpoint, bind=bind, context=ctx, **kw)
        made.append(t)
        return t

    yield _make
    for t in made:
        t.close()


def _endpoint(scheme: str, tmp_path) -> str:
    if scheme == "tcp":
        return "tcp://127.0.0.1:0"
    if scheme == "ipc":
        return f"ipc://{tmp_path}/s"
    return f"inproc://splitrl-test-{os.getpid()}-{next(_names)}"


@pytest.fixture(params=["tcp", "ipc", "inproc"])
def pair(request, make, tmp_path):
    """(binder, connector) over every kind of endpoint."""
    if request.param == "ipc" and (sys.platform == "win32" or len(str(tmp_path)) > 90):
        pytest.skip("ipc needs a POSIX path shorter than sun_path")
    binder = make(_endpoint(request.param, tmp_path), bind=True, name="stage0")  # name: who is at the other end
    connector = make(binder.endpoint, bind=False, name="stage1")
    return binder, connector


@pytest.fixture
def tcp_pair(make):
    binder = make("tcp://127.0.0.1:0", bind=True, name="stage0")  # name: who is at the other end
    connector = make(binder.endpoint, bind=False, name="stage1")
    return binder, connector


@pytest.fixture
def raw_push(ctx):
    """A bare PUSH socket connected to a transport's receiving (PULL) endpoint."""
    sockets: list[zmq.Socket] = []

    def _connect(endpoint: str) -> zmq.Socket:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(T * 1000))
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield _connect
    for sock in sockets:
        sock.close(linger=0)


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, equal_nan=True)


# -- round trips ---------------------------------------------------------------

def test_roundtrip_both_directions(pair):
    binder, connector = pair
    obs = {"obs": torch.randn(4, 3, 8, 8), "done": torch.tensor([True, False, False, True]),
           "empty": torch.zeros(0, 5), "scalar": torch.tensor(3, dtype=torch.int64),
           "bf": torch.randn(2, 7).to(torch.bfloat16), "t": torch.arange(12.0).reshape(3, 4).T}
    connector.send("obs", obs, {"step": 1})
    msg = binder.recv(timeout=T)
    assert (msg.kind, msg.seq, msg.header) == ("obs", 0, {"step": 1})
    assert_same(msg.tensors, obs)

    act = {"action": torch.randn(4, 3)}
    binder.send("act", act, {"step": 1})
    reply = connector.recv(timeout=T)
    assert (reply.kind, reply.seq) == ("act", 0)
    assert_same(reply.tensors, act)


def test_many_messages_arrive_in_order(pair):
    binder, connector = pair
    for i in range(40):  # more than the high-water mark: the receiver drains as we go
        connector.send("x", {"i": torch.tensor([i])}, {"i": i})
        if i % 8 == 7:
            for j in range(i - 7, i + 1):
                msg = binder.recv(timeout=T)
                assert msg.seq == j and msg.header == {"i": j} and msg.tensors["i"].item() == j


def test_large_tensor_roundtrip(tcp_pair):
    binder, connector = tcp_pair
    big = torch.randn(1024, 1024)  # 4 MiB, above pyzmq's zero-copy threshold
    connector.send("big", {"x": big})
    assert torch.equal(binder.recv(timeout=T).tensors["x"], big)


def test_port_zero_gives_a_real_adjacent_port_pair(tcp_pair):
    binder, _ = tcp_pair
    host_port = binder.endpoint.rsplit(":", 1)
    assert host_port[0] == "tcp://127.0.0.1" and 0 < int(host_port[1]) < 65535
    assert paired_endpoint(binder.endpoint) == f"tcp://127.0.0.1:{int(host_port[1]) + 1}"


# -- timeouts --------------------------------------------------------------------

def test_recv_timeout_names_the_peer(pair):
    binder, connector = pair
    with pytest.raises(TransportTimeout, match="stage0") as exc:
        binder.recv(timeout=0.1)
    assert "0.1 s" in str(exc.value)
    with pytest.raises(TransportTimeout, match="stage1"):
        connector.recv(timeout=0.05)


def test_recv_timeout_default_peer_name_is_the_endpoint(make):
    binder = make("tcp://127.0.0.1:0", bind=True)
    with pytest.raises(TransportTimeout, match=f"peer at {binder.endpoint}"):
        binder.recv(timeout=0.05)


def test_recv_uses_the_transport_timeout_by_default(make):
    binder = make("tcp://127.0.0.1:0", bind=True, timeout=0.1)
    with pytest.raises(TransportTimeout, match="0.1 s"):
        binder.recv()


@pytest.mark.parametrize("heartbeat", [0.0, 5.0])
def test_a_receive_gives_up_at_its_timeout_not_a_slice_later(make, caplog, heartbeat):
    """The wait blocks in slices; the time spent in each counts: 1 s is 1 s (a slice late would be 2 s without
    liveness to watch), and the first "waiting for" line says 5 s at about 5 s."""
    binder = make("tcp://127.0.0.1:0", bind=True, name="stage0", heartbeat=heartbeat)
    connector = make(binder.endpoint, bind=False, name="stage1", heartbeat=heartbeat)
    for side in (binder, connector):
        start = time.monotonic()
        with pytest.raises(TransportTimeout):
            side.recv(timeout=1.0)
        assert 1.0 <= time.monotonic() - start < 1.8
    if heartbeat:
        return
    caplog.set_level(logging.INFO, logger="splitrl.transport.zmq_transport")
    start = time.monotonic()
    with pytest.raises(TransportTimeout):
        binder.recv(timeout=5.5)
    assert 5.5 <= time.monotonic() - start < 7.0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert lines == ["waiting for stage0: 5 s so far (giving up after 6 s)"]


def test_send_timeout_without_a_peer(make):
    binder = make("tcp://127.0.0.1:0", bind=True, name="stage0")
    with pytest.raises(TransportTimeout, match="could not send to stage0"):
        binder.send("x", {"a": torch.zeros(2)}, timeout=0.1)
    assert binder.meter.total("sent") == 0  # nothing crossed the link
    # the failed send used no sequence number: a peer arriving now sees seq 0
    connector = make(binder.endpoint, bind=False)
    binder.send("x", timeout=T)
    assert connector.recv(timeout=T).seq == 0


def test_timeout_must_be_positive(make):
    with pytest.raises(ValueError, match="timeout"):
        make("tcp://127.0.0.1:0", bind=True, timeout=0)


def test_connector_queues_before_the_binder_exists(make):
    """Either side may start first: a connector's messages wait for the binder."""
    endpoint = f"inproc://late-{os.getpid()}-{next(_names)}"
    connector = make(endpoint, bind=False)
    connector.send("early", {"a": torch.ones(2)}, timeout=0.5)
    binder = make(endpoint, bind=True)
    assert binder.recv(timeout=T).kind == "early"


# -- garbage and limits ------------------------------------------------------------

GARBAGE = [
    [b"not msgpack \xc1"],
    [b""],
    [b"\x93\x01\x02\x03"],
    [encode("x", 0, None, {"a": torch.zeros(2)})[0]],  # header without its tensor frame
    [bytes(f) for f in encode("x", 0, None, {"a": torch.zeros(2)})] + [b"extra"],
    [b"\x85\xa1v\x02\xa1k\xa1x\xa1s\x00\xa1h\x80\xa1t\x90"],  # protocol version 2
]


@pytest.mark.parametrize("frames", GARBAGE, ids=range(len(GARBAGE)))
@pytest.mark.parametrize("kind", ["tcp", "ipc", "inproc"])
def test_garbage_is_a_protocol_error_and_the_receiver_keeps_working(make, raw_push, tmp_path, kind, frames):
    binder = make(_endpoint(kind, tmp_path), bind=True, name="stage0")
    raw = raw_push(binder.endpoint)  # the binder's one peer, speaking the documented bytes
    raw.send_multipart(frames)
    with pytest.raises(ProtocolError, match="from stage0"):
        binder.recv(timeout=T)
    invalid = binder.meter.entry(INVALID_KIND, "recv")
    assert invalid.messages == 1 and invalid.bytes == sum(len(f) for f in frames)
    # garbage consumes no sequence number: the peer's seq 0 is accepted
    raw.send_multipart(encode("x", 0, tensors={"a": torch.ones(3)}))
    msg = binder.recv(timeout=T)
    assert msg.seq == 0 and torch.equal(msg.tensors["a"], torch.ones(3))


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_a_second_peer_is_refused_and_told_while_the_session_goes_on(make, raw_push, tmp_path, kind):
    binder = make(_endpoint(kind, tmp_path), bind=True, name="stage0", heartbeat=5)
    first = make(binder.endpoint, bind=False, name="stage1", heartbeat=5)
    first.send("x")
    assert binder.recv(timeout=T).kind == "x"
    second = make(binder.endpoint, bind=False, name="stage1", heartbeat=5)
    with pytest.raises(PeerGone, match="refused this connection: it is serving another peer"):
        second.send("x")  # the refusal may come before its socket has anywhere to queue this: then here
        second.recv(timeout=T)
    stray = raw_push(binder.endpoint)  # a bare socket's frames never arrive
    with contextlib.suppress(zmq.Again):  # (refused before its handshake ends, it may take none at all)
        stray.send_multipart([b"\x00"])
    first.send("y", {"a": torch.ones(2)})
    binder.send("z")
    assert binder.recv(timeout=T).kind == "y" and first.recv(timeout=T).kind == "z"
    deadline = time.monotonic() + T  # both of second's sockets (and the stray one): the gate's thread counts them
    while binder.gate.refused[BUSY] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert binder.gate.refused[BUSY] >= 2
    assert binder.meter.entry(INVALID_KIND, "recv").messages == 0


def test_two_peers_reaching_for_one_place_together_leave_it_held_by_the_one_admitted(make, raw_push):
    """Both accepted before either is answered: the gate cannot tell which one a ZAP request is from, and the
    refused one's close must not count as the admitted one's (a fleet's edges racing for a place, where stage1
    once declared edge 0 gone while it trained on)."""
    binder = make("tcp://127.0.0.1:0", bind=True, name="stage0", heartbeat=5)
    sockets = [raw_push(binder.endpoint) for _ in range(2)]
    slot = binder.gate._slots[b"recv"]
    deadline = time.monotonic() + T
    while not (binder.gate.refused[BUSY] == 1 and len(slot.holders) == 1) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the refused connection's close has been read
    assert binder.gate.refused[BUSY] == 1 and len(slot.holders) == 1
    assert binder.gate.holder("recv") is not None and binder.gate.vacated_since("recv") is None
    for sock in sockets:
        sock.close(linger=0)
    deadline = time.monotonic() + T
    while binder.gate.vacated_since("recv") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert binder.gate.holder("recv") is None and binder.gate.vacated_since("recv") is not None


def test_the_gate_holds_a_place_until_every_connection_that_may_hold_it_has_closed():
    """The bookkeeping alone, in the order that fooled the newest-accepted guess: accepted 3, accepted 4, the
    request from 3 admitted, 4's refused; 4 closes (still held), 3 closes (vacated); a later peer is admitted."""
    slot = _Slot("test")
    slot.accepted(3)
    slot.accepted(4)
    assert slot.admit() and slot.generation == 1
    assert not slot.admit()  # 4's request: busy
    slot.closed(4, now=1.0)
    assert slot.held and slot.vacated_at is None
    slot.accepted(5)  # a stranger after the admission is not a holder
    slot.closed(5, now=1.5)
    assert slot.held
    slot.closed(3, now=2.0)
    assert not slot.held and slot.vacated_at == 2.0
    slot.accepted(6)
    assert slot.admit() and slot.generation == 2 and slot.vacated_at is None
    slot.closed(6, now=3.0)
    assert slot.vacated_at == 3.0
    slot.accepted(7)
    slot.closed(7, now=4.0)
    assert slot.admit() and not slot.held and slot.generation == 2  # 7 asked after it had gone: nothing held
    slot.accepted(8)  # a stranger that never greets, accepted before the next peer: it might be the holder...
    slot.accepted(9)
    assert slot.admit()
    slot.closed(9, now=5.0)
    assert slot.held  # ...until libzmq drops it at the handshake timeout
    slot.closed(8, now=6.0)
    assert not slot.held and slot.vacated_at == 6.0


def test_limits_apply_on_receive(make):
    binder = make("tcp://127.0.0.1:0", bind=True, limits=WireLimits(kinds={"act"}, max_ndim=2))
    connector = make(binder.endpoint, bind=False)
    connector.send("obs")
    with pytest.raises(ProtocolError, match="message kind"):
        binder.recv(timeout=T)
    connector.send("act", {"a": torch.zeros(1, 1, 1)})
    with pytest.raises(ProtocolError, match="shape"):
        binder.recv(timeout=T)
    connector.send("act", {"a": torch.zeros(1, 1)})
    # the two rejected messages count as lost: the receiver resynchronises on this one
    with pytest.raises(ProtocolError, match="2 message"):
        binder.recv(timeout=T)
    connector.send("act", {"a": torch.zeros(1, 1)})
    assert binder.recv(timeout=T).seq == 3


def test_oversized_frame_drops_the_connection_before_allocation(make):
    """MAXMSGSIZE: libzmq disconnects a peer that sends a frame above the limit; the peer
    reconnects and the next message shows the loss as a sequence gap."""
    limits = WireLimits(max_header_bytes=1024, max_tensor_bytes=1024)
    binder = make("tcp://127.0.0.1:0", bind=True, limits=limits)
    connector = make(binder.endpoint, bind=False)
    connector.send("x", {"big": torch.zeros(4096)})  # a 16 KiB frame
    with pytest.raises(TransportTimeout):
        binder.recv(timeout=0.5)
    connector.send("x", {"small": torch.zeros(4)})
    with pytest.raises(ProtocolError, match="expected 0, got 1"):
        binder.recv(timeout=T)
    connector.send("x")
    assert binder.recv(timeout=T).seq == 2


# -- sequence numbers ------------------------------------------------------------------

def test_sequence_numbers_count_per_direction(pair):
    binder, connector = pair
    for i in range(3):
        connector.send("a")
    binder.send("b")
    assert [binder.recv(timeout=T).seq for _ in range(3)] == [0, 1, 2]
    assert connector.recv(timeout=T).seq == 0


@pytest.mark.parametrize("kind", ["tcp", "ipc", "inproc"])
def test_gap_from_a_raw_socket(make, raw_push, tmp_path, kind):
    binder = make(_endpoint(kind, tmp_path), bind=True, name="stage0")
    raw = raw_push(binder.endpoint)  # the binder's one peer
    for seq in range(2):
        raw.send_multipart(encode("x", seq))
    assert [binder.recv(timeout=T).seq for _ in range(2)] == [0, 1]
    raw.send_multipart(encode("x", 1 + 2, None, {"a": torch.zeros(1)}))  # seq 2 was "lost"
    with pytest.raises(ProtocolError) as exc:
        binder.recv(timeout=T)
    assert "expected 2, got 3" in str(exc.value) and "1 message(s) lost" in str(exc.value)
    assert "dropped" in str(exc.value) and "stage0" in str(exc.value)
    # the receiver continues after the gap
    raw.send_multipart(encode("x", 4))
    assert binder.recv(timeout=T).seq == 4


def test_gap_from_a_skipped_sequence_number(pair):
    binder, connector = pair
    connector.send("x")
    connector._send_seq += 2  # two messages lost on the way
    connector.send("x", {"a": torch.ones(1)})
    connector.send("x")
    assert binder.recv(timeout=T).seq == 0
    with pytest.raises(ProtocolError, match="expected 1, got 3 \\(2 message\\(s\\) lost\\)"):
        binder.recv(timeout=T)
    assert binder.recv(timeout=T).seq == 4
    # a dropped message still crossed the link and is counted
    assert binder.meter.entry("x", "recv").messages == 3


def test_duplicate_is_detected(pair):
    binder, connector = pair
    connector.send("x")
    connector.send("x")
    connector._send_seq = 1  # replay seq 1
    connector.send("x")
    assert [binder.recv(timeout=T).seq for _ in range(2)] == [0, 1]
    with pytest.raises(ProtocolError, match="expected 2, got 1 \\(a duplicate or replay\\)"):
        binder.recv(timeout=T)


def test_duplicate_does_not_rewind_the_expected_sequence_number(pair):
    """After a replayed old message is dropped, the next genuine message must be accepted."""
    binder, connector = pair
    for _ in range(3):
        connector.send("x")  # seq 0, 1, 2
    connector._send_seq = 1
    connector.send("x")  # a replay of seq 1
    connector._send_seq = 3
    connector.send("x")  # the genuine next message
    assert [binder.recv(timeout=T).seq for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ProtocolError, match="duplicate"):
        binder.recv(timeout=T)
    assert binder.recv(timeout=T).seq == 3


# -- byte meters -----------------------------------------------------------------------

def test_byte_meters_equal_the_frame_lengths(pair):
    binder, connector = pair
    messages = [
        ("obs", {"obs": torch.randn(4, 16), "r": torch.zeros(4)}, {"t": 1}),
        ("obs", {"obs": torch.randn(4, 16), "r": torch.zeros(4)}, {"t": 2}),
        ("stats", {}, {"loss": 0.5}),
        ("obs", {"obs": torch.randn(0, 16)}, None),
    ]
    expected: dict[str, list[int]] = {}
    for seq, (kind, tensors, header) in enumerate(messages):
        frames = encode(kind, seq, header, tensors)
        size = sum(frame_nbytes(f) for f in frames)
        e = expected.setdefault(kind, [0, 0, 0])
        e[0] += size
        e[1] += 1
        e[2] += len(frames)
        assert connector.send(kind, tensors, header) == size
        assert binder.recv(timeout=T).nbytes == size
    for kind, (nbytes, nmsgs, nframes) in expected.items():
        for meter, direction in ((connector.meter, "sent"), (binder.meter, "recv")):
            entry = meter.entry(kind, direction)
            assert (entry.bytes, entry.messages, entry.frames) == (nbytes, nmsgs, nframes)
    total = sum(v[0] for v in expected.values())
    assert connector.meter.total("sent") == binder.meter.total("recv") == total
    assert connector.meter.total("recv") == binder.meter.total("sent") == 0
    snap = binder.meter.snapshot()
    assert snap["net/obs/recv_bytes"] == expected["obs"][0] and snap["net/obs/recv_messages"] == 3
    assert snap["net/stats/recv_bytes"] == expected["stats"][0]


# -- abort and close ---------------------------------------------------------------------

def test_abort_raises_peer_abort_on_the_other_side(pair):
    binder, connector = pair
    connector.abort("CUDA out of memory")
    with pytest.raises(PeerAbort, match="stage0 stopped: CUDA out of memory"):
        binder.recv(timeout=T)
    binder.abort("shutting down")
    with pytest.raises(PeerAbort, match="shutting down"):
        connector.recv(timeout=T)
    assert binder.meter.entry("abort", "recv").messages == 1


def test_abort_without_a_peer_never_raises(make):
    binder = make("tcp://127.0.0.1:0", bind=True)
    binder.abort("nobody listens", timeout=0.05)
    binder.close()
    binder.abort("closed already")


def test_closed_transport_refuses_use(make):
    binder = make("tcp://127.0.0.1:0", bind=True)
    binder.close()
    binder.close()  # idempotent
    with pytest.raises(TransportClosed):
        binder.send("x")
    with pytest.raises(TransportClosed):
        binder.recv(timeout=0.01)


def test_context_manager_closes(ctx):
    with ZmqTransport("tcp://127.0.0.1:0", bind=True, context=ctx, linger=0) as t:
        pass
    with pytest.raises(TransportClosed):
        t.recv(timeout=0.01)


def test_bind_twice_is_a_value_error(make):
    binder = make("tcp://127.0.0.1:0", bind=True)
    with pytest.raises(ValueError, match="cannot bind"):
        make(binder.endpoint, bind=True)


# -- paired endpoints --------------------------------------------------------------------

@pytest.mark.parametrize("endpoint, paired", [
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"),
    ("tcp://localhost:1", "tcp://localhost:2"),
    ("tcp://server.example.org:65534", "tcp://server.example.org:65535"),
    ("tcp://*:7000", "tcp://*:7001"),
    ("tcp://[::1]:9000", "tcp://[::1]:9001"),
    ("tcp://0.0.0.0:0", "tcp://0.0.0.0:1"),
    ("ipc:///tmp/splitrl.sock", "ipc:///tmp/splitrl.sock-r"),
    ("ipc://relative", "ipc://relative-r"),
    ("inproc://link", "inproc://link-r"),
])
def test_paired_endpoint(endpoint, paired):
    assert paired_endpoint(endpoint) == paired


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:65535",  # no port after it
    "tcp://127.0.0.1:*",  # wildcard port
    "tcp://127.0.0.1",  # no port
    "tcp://127.0.0.1:http",
    "udp://127.0.0.1:5555",
    "ipc://",
    "inproc://",
    "127.0.0.1:5555",
    "",
])
def test_paired_endpoint_rejects(endpoint):
    with pytest.raises(ValueError):
        paired_endpoint(endpoint)


def test_connect_to_an_unsupported_endpoint_is_a_value_error(ctx):
    with pytest.raises(ValueError, match="cannot connect"):
        ZmqTransport("udp://127.0.0.1:5555", bind=False, context=ctx, linger=0)


# -- handshake ---------------------------------------------------------------------------

SETTINGS = {"obs_shape": [3, 96, 96], "feature_dim": 256, "codec": "bf16", "seed": 1, "lr": 2.5e-4}


def _both(binder, connector, binder_args, connector_args):
    """Run the two handshakes concurrently; return (result or exception) per side."""
    def run(transport, args):
        try:
            if transport is binder:
                return answer_hello(transport, *args, timeout=T)
            return handshake(transport, *args, timeout=T)
        except Exception as exc:  # returned, not raised, so both sides can be checked
            return exc

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run, binder, binder_args)
        mine = run(connector, connector_args)
        theirs = future.result(timeout=3 * T)
    return theirs, mine


def test_handshake_success(pair):
    binder, connector = pair
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", dict(SETTINGS)))
    assert b["role"] == "stage0" and c["role"] == "stage1"
    for hello in (b, c):
        assert hello["proto"] == 1 and hello["settings_hash"] == settings_hash(SETTINGS)
    assert b["settings"] == SETTINGS and "settings" not in c  # stage1 reveals its hash only
    assert binder.session == connector.session and binder.session is not None
    # the hellos were seq 0; the application's messages follow from 1
    connector.send("obs")
    assert binder.recv(timeout=T).seq == 1
    assert binder.meter.entry("hello", "recv").messages == 1


def test_handshake_mismatch_stops_both_sides_naming_the_settings(pair):
    binder, connector = pair
    other = dict(SETTINGS, codec="int8", seed=2)
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", other))
    for err in (b, c):
        assert isinstance(err, HandshakeError) and isinstance(err, ProtocolError)
        text = str(err)
        assert "codec" in text and "seed" in text and "lr" not in text and "feature_dim" not in text
    assert "codec: stage1='bf16' stage0='int8'" in str(b)
    assert "codec: stage0='int8'; seed: stage0=2; (stage1's values are in its log)" in str(c)
    assert "bf16" not in str(c)


def test_handshake_missing_setting_is_named(tcp_pair):
    binder, connector = tcp_pair
    fewer = {k: v for k, v in SETTINGS.items() if k != "seed"}
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", fewer))
    assert "seed: stage1=1 stage0='<unset>'" in str(b)
    assert "seed: stage0='<unset>'" in str(c) and "stage1=1" not in str(c)


def test_handshake_wrong_role(tcp_pair):
    binder, connector = tcp_pair
    b, c = _both(binder, connector, ("stage0", "stage1", SETTINGS), ("stage0", "stage1", SETTINGS))
    for err in (b, c):
        assert isinstance(err, HandshakeError)
        assert "expected a stage1, got 'stage0'" in str(err) and "same stage" in str(err)


def test_handshake_unexpected_role(tcp_pair):
    binder, connector = tcp_pair
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("learner", "stage1", SETTINGS))
    assert isinstance(b, HandshakeError) and "expected a stage0, got 'learner'" in str(b)
    assert isinstance(c, dict)  # the learner is happy with its peer; its next recv will fail


def test_the_initiator_rejects_a_non_hello_answer(tcp_pair):
    binder, connector = tcp_pair
    binder.send("obs")
    with pytest.raises(HandshakeError, match="expected a 'hello' message, got 'obs'"):
        handshake(connector, "stage0", "stage1", SETTINGS, timeout=T)


def test_the_responder_drops_what_comes_before_the_hello(tcp_pair):
    binder, connector = tcp_pair
    connector._send_frames(encode("obs", 0), T)  # a stranger's message, as far as the responder can tell
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", SETTINGS))
    assert b["role"] == "stage0" and c["role"] == "stage1"
    assert binder.strangers == 1 and binder.meter.entry("_stranger", "recv").messages == 1


def test_messages_of_another_session_are_dropped_and_counted(tcp_pair):
    binder, connector = tcp_pair
    _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", SETTINGS))
    other = connector.session % (2**32 - 1) + 1
    # another session's message, one of no session, and frames that do not decode: dropped, not fatal
    for frames in (encode("obs", 1, sid=other), encode("obs", 1), [b"\xc1"]):
        connector._send_frames(frames, T)
    connector.send("obs", header={"n": 3})
    assert binder.recv(timeout=T).header == {"n": 3}
    assert binder.strangers == 3 and binder.meter.entry("_stranger", "recv").messages == 3


def test_handshake_times_out_without_a_peer(make):
    connector = make("tcp://127.0.0.1:1", bind=False)  # queues the hello, nobody answers
    with pytest.raises(TransportTimeout):
        handshake(connector, "stage0", "stage1", SETTINGS, timeout=0.1)


def test_settings_hash_is_canonical_json():
    import hashlib

    assert settings_hash({"b": 1, "a": [1.5, True, None]}) == hashlib.sha256(
        b'{"a":[1.5,true,null],"b":1}'
    ).hexdigest()
    assert settings_hash({"a": 1, "b": 2}) == settings_hash({"b": 2, "a": 1})
    assert settings_hash({"shape": (3, 96)}) == settings_hash({"shape": [3, 96]})
    # the worked example in docs/PROTOCOL.md
    example = {"shape": [3, 96, 96], "name": "café", "gamma": 0.99, "eps": 1e-05, "codec": "bf16"}
    canonical = b'{"codec":"bf16","eps":1e-05,"gamma":0.99,"name":"caf\\u00e9","shape":[3,96,96]}'
    assert settings_hash(example) == hashlib.sha256(canonical).hexdigest() == (
        "2112db70da3a6f402a9c29f75558b7a61f5c1b8ceb930cfa1df12943d697edeb"
    )


def test_a_message_of_too_many_frames_is_dropped_part_by_part_and_the_link_goes_on(make, raw_push):
    binder = make("tcp://127.0.0.1:0", bind=True, name="stage0")
    sock = raw_push(binder.endpoint)  # the binder's one peer
    head = msgpack.packb({"v": 1, "k": "x", "s": 0, "h": {}, "t": []})
    sock.send_multipart([head] + [b"\x00" * 1024] * 100)  # 101 frames: over the 65 a message may have
    with pytest.raises(ProtocolError, match="message of 101 frames and 102[0-9]+ bytes: expected at most 65 frames"):
        binder.recv(timeout=T)
    sock.send_multipart([head])
    assert binder.recv(timeout=T).kind == "x"


def test_a_watch_over_several_links_says_which_have_a_message_and_waits_no_longer_than_asked(make):
    """What a fleet's stage1 acting as its edges come waits on (`Transport.watch`)."""
    pairs = []
    for k in range(3):
        binder = make("tcp://127.0.0.1:0", bind=True, name=f"edge {k}")
        pairs.append((binder, make(binder.endpoint, bind=False, name="stage1")))
    binders = [b for b, _ in pairs]
    watch = binders[0].watch(binders)
    start = time.monotonic()
    assert watch.wait(0.2) == []
    assert 0.15 <= time.monotonic() - start < 2.0
    pairs[2][1].send("step", header={"t": 0})
    pairs[0][1].send("step", header={"t": 0})
    deadline = time.monotonic() + T
    ready: list[int] = []
    while len(ready) < 2 and time.monotonic() < deadline:  # the two may land a moment apart
        ready = watch.wait(T)
        time.sleep(0.01)
    assert ready == [0, 2]
    assert binders[2].pending() and binders[0].pending() and not binders[1].pending()
    assert binders[2].recv(T).header == {"t": 0}
    assert watch.wait(0.0) == [0]


def test_the_generic_watch_looks_at_each_link():
    from splitrl.transport.local import LocalTransport
    a, b = LocalTransport.pair("stage1", "edge 0")
    c, d = LocalTransport.pair("stage1", "edge 1")
    watch = LocalTransport.watch([b, d])
    assert watch.wait(0.01) == []
    c.send("step")
    assert watch.wait(T) == [1]
