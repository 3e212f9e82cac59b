"""ZmqTransport over tcp, ipc and inproc: round trips, timeouts, garbage and limits, sequence
numbers, byte meters, abort and close, paired endpoints, and a watch over several links.

Every receive has a timeout of at most 5 s and every socket is closed in a fixture
or a ``finally``, so no test can hang or leak a socket into the next one.
"""

from __future__ import annotations

import logging
import os
import time

import msgpack
import pytest
import torch

from splitrl.transport import (
    PeerAbort,
    ProtocolError,
    TransportClosed,
    TransportTimeout,
    WireLimits,
    ZmqTransport,
    encode,
    paired_endpoint,
)
from splitrl.transport.base import INVALID_KIND
from splitrl.transport.wire import frame_nbytes

from .zmq_support import T, assert_same, endpoint_for, unique_ids


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
    endpoint = f"inproc://late-{os.getpid()}-{next(unique_ids)}"
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
    binder = make(endpoint_for(kind, tmp_path), bind=True, name="stage0")
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
    binder = make(endpoint_for(kind, tmp_path), bind=True, name="stage0")
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
