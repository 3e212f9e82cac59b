"""TcpTransport: round trips, framing limits, timeouts that keep partial data, peer loss.

Every receive has a timeout of a few seconds at most, so a bug fails instead of hanging.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from typing import Any, Iterator

import pytest
import torch

from splitrl.launch import free_port
from splitrl.transport import (
    PeerGone,
    ProtocolError,
    TcpTransport,
    TransportClosed,
    TransportTimeout,
    WireLimits,
    encode,
)
from splitrl.transport.wire import frame_nbytes

T = 5.0  # generous per-call timeout; tests that expect a timeout use much less


def framed(frames: list[Any]) -> bytes:
    """The plain TCP framing written independently of the transport: u32 count, (u64 length, bytes)*."""
    out = [struct.pack("<I", len(frames))]
    for f in frames:
        data = bytes(f)
        out.append(struct.pack("<Q", len(data)))
        out.append(data)
    return b"".join(out)


def host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    return host, int(port)


@pytest.fixture
def server() -> Iterator[TcpTransport]:
    t = TcpTransport("tcp://127.0.0.1:0", bind=True, timeout=T)
    yield t
    t.close()


@pytest.fixture
def pair(server: TcpTransport) -> Iterator[tuple[TcpTransport, TcpTransport]]:
    client = TcpTransport(server.endpoint, bind=False, timeout=T)
    yield server, client
    client.close()


@pytest.fixture
def raw_peer(server: TcpTransport) -> Iterator[socket.socket]:
    sock = socket.create_connection(host_port(server.endpoint), timeout=T)
    yield sock
    sock.close()


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 4, generator=g),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (7,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8, generator=g),
        "i16": torch.randint(-1000, 1000, (4,), dtype=torch.int16, generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (4,), dtype=torch.int32, generator=g),
        "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3) * (2**40),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(20, dtype=torch.float32).reshape(4, 5).t(),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


# -- round trips ---------------------------------------------------------------------


def test_round_trip_all_dtypes_both_directions(pair: tuple[TcpTransport, TcpTransport]) -> None:
    server, client = pair
    tensors = sample_tensors()
    client.send("features", tensors, header={"step": 7, "note": "hi"})
    msg = server.recv()
    assert (msg.kind, msg.header, msg.seq) == ("features", {"step": 7, "note": "hi"}, 0)
    assert_same(msg.tensors, tensors)
    # Received tensors live in writable, aligned frames: usable in place.
    msg.tensors["f32"].add_(1)

    server.send("actions", {"a": tensors["bf16"]})
    back = client.recv()
    assert back.kind == "actions" and back.seq == 0
    assert_same(back.tensors, {"a": tensors["bf16"]})


def test_messages_without_tensors_and_many_in_flight(pair: tuple[TcpTransport, TcpTransport]) -> None:
    server, client = pair
    for i in range(50):
        client.send("tick", header={"i": i})
    for i in range(50):
        msg = server.recv()
        assert (msg.kind, msg.header, msg.tensors, msg.seq) == ("tick", {"i": i}, {}, i)


def test_large_messages_cross_in_both_directions_at_once(pair: tuple[TcpTransport, TcpTransport]) -> None:
    # Larger than the socket buffers, so sends go out in parts and receives read straight into frames.
    server, client = pair
    big = {"x": torch.randn(3 << 20), "y": torch.arange(100_000, dtype=torch.int16)}
    errors: list[BaseException] = []

    def echo() -> None:
        try:
            for _ in range(2):
                msg = server.recv()
                server.send("echo", msg.tensors)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=echo)
    thread.start()
    try:
        for _ in range(2):
            client.send("big", big)
            assert_same(client.recv().tensors, big)
    finally:
        thread.join(T)
    assert not errors


def test_either_side_may_start_first() -> None:
    port = free_port()
    client = TcpTransport(f"tcp://127.0.0.1:{port}", bind=False, timeout=T)
    result: list[Any] = []
    sender = threading.Thread(target=lambda: result.append(client.send("hello_there", {"x": torch.ones(2)})))
    sender.start()
    try:
        time.sleep(0.3)  # the client is retrying against a closed port meanwhile
        with TcpTransport(f"tcp://127.0.0.1:{port}", bind=True, timeout=T) as server:
            msg = server.recv()
            assert msg.kind == "hello_there"
            assert torch.equal(msg.tensors["x"], torch.ones(2))
    finally:
        sender.join(T)
        client.close()
    assert result and result[0] > 0


def test_port_zero_reports_the_real_endpoint(server: TcpTransport) -> None:
    host, port = host_port(server.endpoint)
    assert host == "127.0.0.1" and port > 0
    assert server.peer == f"peer at {server.endpoint}"


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/x", "tcp://127.0.0.1", "tcp://127.0.0.1:99999", "tcp://:5"])
def test_bad_endpoints_are_value_errors(endpoint: str) -> None:
    with pytest.raises(ValueError):
        TcpTransport(endpoint, bind=True)


def test_binding_a_port_in_use_is_a_value_error(server: TcpTransport) -> None:
    with pytest.raises(ValueError, match="cannot bind"):
        TcpTransport(server.endpoint, bind=True)


def test_connecting_to_the_wildcard_host_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="wildcard"):
        TcpTransport("tcp://*:5555", bind=False)


# -- timeouts ------------------------------------------------------------------------


def test_recv_times_out_without_a_peer(server: TcpTransport) -> None:
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match="no peer connected"):
        server.recv(timeout=0.2)
    assert time.monotonic() - start < 2.0


def test_connect_times_out_without_a_listener() -> None:
    with TcpTransport(f"tcp://127.0.0.1:{free_port()}", bind=False, timeout=0.3) as client:
        start = time.monotonic()
        with pytest.raises(TransportTimeout, match="cannot connect"):
            client.send("x")
        assert time.monotonic() - start < 2.0


def test_recv_times_out_when_the_peer_is_silent(pair: tuple[TcpTransport, TcpTransport]) -> None:
    server, client = pair
    client.send("ping")
    server.recv()
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match="no message from"):
        server.recv(timeout=0.2)
    assert time.monotonic() - start < 2.0
    # The timeout left the link usable.
    client.send("ping")
    assert server.recv().seq == 1


def test_send_times_out_when_the_peer_does_not_read(pair: tuple[TcpTransport, TcpTransport]) -> None:
    server, client = pair
    chunk = {"x": torch.zeros(1 << 20, dtype=torch.uint8)}
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match="could not send"):
        for _ in range(1000):  # fills both socket buffers; the server never reads
            client.send("fill", chunk, timeout=0.2)
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("tensor_bytes", [16, 300_000])
@pytest.mark.parametrize("split", [2, 4 + 3, 12 + 5, "mid-tensor", "last-byte"])
def test_timeout_mid_message_keeps_the_partial_message(
    server: TcpTransport, raw_peer: socket.socket, split: Any, tensor_bytes: int
) -> None:
    tensor = torch.arange(tensor_bytes, dtype=torch.int32).to(torch.uint8)
    data = framed(encode("features", 0, {"a": 1}, {"x": tensor}))
    cut = {"mid-tensor": len(data) - tensor_bytes // 2, "last-byte": len(data) - 1}.get(split, split)
    raw_peer.sendall(data[:cut])
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match="kept for the next recv"):
        server.recv(timeout=0.3)
    assert time.monotonic() - start < 2.0
    raw_peer.sendall(data[cut:])
    msg = server.recv(timeout=T)
    assert msg.header == {"a": 1}
    assert torch.equal(msg.tensors["x"], tensor)


def test_stream_cut_into_random_pieces_decodes_every_message(server: TcpTransport, raw_peer: socket.socket) -> None:
    rng = random.Random(1234)
    sizes = [0, 1, 7, 100, 5000, 70_000, 200_000, 3]
    payloads = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    stream = b"".join(framed(encode("chunk", seq, {"n": len(p)}, {"p": p})) for seq, p in enumerate(payloads))

    def trickle() -> None:
        pos = 0
        while pos < len(stream):
            step = rng.choice([1, 2, 5, 13, 1000, 65_536, 300_000])
            raw_peer.sendall(stream[pos : pos + step])
            pos += step
            if rng.random() < 0.05:
                time.sleep(0.01)

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        for seq, p in enumerate(payloads):
            msg = server.recv(timeout=T)
            assert msg.seq == seq and torch.equal(msg.tensors["p"], p)
    finally:
        thread.join(T)


# -- framing limits ------------------------------------------------------------------


def _assert_dropped_then_usable(server: TcpTransport, raw_peer: socket.socket) -> None:
    """After a framing error the old connection is closed and a new peer is accepted."""
    raw_peer.settimeout(T)
    assert raw_peer.recv(1) == b""
    with socket.create_connection(host_port(server.endpoint), timeout=T) as fresh:
        fresh.sendall(framed(encode("ok", 0)))
        assert server.recv(timeout=T).kind == "ok"


@pytest.mark.parametrize("count", [0, 66, 2**32 - 1])
def test_bad_frame_count_is_a_protocol_error(server: TcpTransport, raw_peer: socket.socket, count: int) -> None:
    raw_peer.sendall(struct.pack("<I", count))
    with pytest.raises(ProtocolError, match="frame count.*out of sync"):
        server.recv(timeout=T)
    _assert_dropped_then_usable(server, raw_peer)


def test_oversize_header_length_is_rejected_before_allocation(server: TcpTransport, raw_peer: socket.socket) -> None:
    # 2**60 bytes could never be allocated: a MemoryError here would mean the check came too late.
    raw_peer.sendall(struct.pack("<IQ", 1, 2**60))
    with pytest.raises(ProtocolError, match="header frame length"):
        server.recv(timeout=T)
    _assert_dropped_then_usable(server, raw_peer)


def test_oversize_tensor_frame_is_rejected() -> None:
    limits = WireLimits(max_tensor_bytes=1000)
    with TcpTransport("tcp://127.0.0.1:0", bind=True, timeout=T, limits=limits) as server:
        with socket.create_connection(host_port(server.endpoint), timeout=T) as peer:
            header = encode("x", 0)[0]
            peer.sendall(struct.pack("<IQ", 2, len(header)) + header + struct.pack("<Q", 1001))
            with pytest.raises(ProtocolError, match=r"frame #1 length: expected at most 1000 bytes, got 1001"):
                server.recv()
            _assert_dropped_then_usable(server, peer)


def test_oversize_message_is_rejected() -> None:
    limits = WireLimits(max_tensor_bytes=1000, max_message_bytes=1500)
    with TcpTransport("tcp://127.0.0.1:0", bind=True, timeout=T, limits=limits) as server:
        with socket.create_connection(host_port(server.endpoint), timeout=T) as peer:
            frames = encode("x", 0, None, {"a": torch.zeros(900, dtype=torch.uint8), "b": torch.zeros(900, dtype=torch.uint8)})
            peer.sendall(framed(frames))
            with pytest.raises(ProtocolError, match="message size"):
                server.recv()
            _assert_dropped_then_usable(server, peer)


def test_undecodable_message_keeps_the_connection(server: TcpTransport, raw_peer: socket.socket) -> None:
    # Well framed but not a valid message: decode rejects it, the stream is still in sync.
    raw_peer.sendall(framed([b"\xc1garbage"]) + framed(encode("ok", 0)))
    with pytest.raises(ProtocolError, match="header frame"):
        server.recv(timeout=T)
    assert server.recv(timeout=T).kind == "ok"


# -- peer loss and closing ----------------------------------------------------------


def test_peer_close_between_messages_is_peer_gone(pair: tuple[TcpTransport, TcpTransport]) -> None:
    server, client = pair
    client.send("ping")
    client.close()
    assert server.recv().kind == "ping"
    start = time.monotonic()
    with pytest.raises(PeerGone, match=r"^peer at tcp://127\.0\.0\.1:\d+ closed the connection$"):
        server.recv(timeout=T)
    assert time.monotonic() - start < 2.0


def test_peer_close_mid_message_is_peer_gone(server: TcpTransport, raw_peer: socket.socket) -> None:
    data = framed(encode("x", 0, None, {"t": torch.ones(100)}))
    raw_peer.sendall(data[:50])
    raw_peer.close()
    with pytest.raises(PeerGone, match="closed the connection in the middle of a message"):
        server.recv(timeout=T)


def test_send_to_a_closed_peer_is_peer_gone(pair: tuple[TcpTransport, TcpTransport]) -> None:
    server, client = pair
    client.send("ping")
    server.recv()
    client.close()
    deadline = time.monotonic() + T
    with pytest.raises(PeerGone, match="closed the connection"):
        # The first send may still land in the kernel buffer; the peer's reset fails a later one.
        while time.monotonic() < deadline:
            server.send("pong", {"x": torch.zeros(1000)})
            time.sleep(0.01)


def test_bound_side_accepts_a_new_peer_after_peer_gone(server: TcpTransport) -> None:
    first = TcpTransport(server.endpoint, bind=False, timeout=T)
    first.send("a")
    first.close()
    assert server.recv().kind == "a"
    with pytest.raises(PeerGone):
        server.recv()
    with socket.create_connection(host_port(server.endpoint), timeout=T) as second:
        # The server's sequence numbers run on across peers, so the newcomer continues at 1.
        second.sendall(framed(encode("b", 1)))
        assert server.recv().kind == "b"


def test_close_is_quick_and_final(pair: tuple[TcpTransport, TcpTransport]) -> None:
    server, client = pair
    client.send("x", {"t": torch.zeros(1 << 18, dtype=torch.uint8)})  # unread data in flight
    start = time.monotonic()
    client.close()
    server.close()
    client.close()  # idempotent
    assert time.monotonic() - start < 1.0
    with pytest.raises(TransportClosed):
        server.recv(timeout=0.1)
    with pytest.raises(TransportClosed):
        client.send("x")


# -- byte meters --------------------------------------------------------------------


def test_meters_count_the_frame_lengths(pair: tuple[TcpTransport, TcpTransport]) -> None:
    server, client = pair
    tensors = sample_tensors()
    expected = sum(frame_nbytes(f) for f in encode("features", 0, {"k": 1}, tensors))
    assert client.send("features", tensors, header={"k": 1}) == expected
    msg = server.recv()
    assert msg.nbytes == expected
    sent, received = client.meter.entry("features", "sent"), server.meter.entry("features", "recv")
    assert (sent.bytes, sent.messages, sent.frames) == (expected, 1, len(tensors) + 1)
    assert (received.bytes, received.messages, received.frames) == (expected, 1, len(tensors) + 1)
    assert client.meter.total("sent") == server.meter.total("recv") == expected


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_an_announced_frame_costs_memory_only_as_its_bytes_arrive(server: TcpTransport, raw_peer: socket.socket) -> None:
    # A hostile peer announces a 200 MiB tensor frame after a valid header and sends 16 KB of it.
    header = b"\x85\xa1v\x01\xa1k\xa1x\xa1s\x00\xa1h\x80\xa1t\x91\x94\xa1a\xa5uint8\x91\xce\x0c\x80\x00\x00\x01"
    before = _rss_mib()
    raw_peer.sendall(struct.pack("<I", 2) + struct.pack("<Q", len(header)) + header
                     + struct.pack("<Q", 200 * 1024 * 1024) + b"\x00" * 16384)
    with pytest.raises(TransportTimeout):
        server.recv(timeout=1.0)
    grown = _rss_mib() - before
    assert grown < 32, f"RSS grew {grown:.0f} MiB for 16 KB received"  # it was 200 MiB: the whole announced frame


def test_a_frame_that_grows_as_it_arrives_is_received_whole(server: TcpTransport, raw_peer: socket.socket) -> None:
    payload = random.Random(3).randbytes(9 * 1024 * 1024 + 5)
    tensors = {"t": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}
    from splitrl.transport.wire import encode

    sender = threading.Thread(target=raw_peer.sendall, args=(framed(encode("x", 0, tensors=tensors)),), daemon=True)
    sender.start()
    msg = server.recv(timeout=30)
    sender.join(10)
    assert bytes(msg.tensors["t"].numpy()) == payload
