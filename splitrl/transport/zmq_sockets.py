"""ZeroMQ socket setup for `ZmqTransport`: the options each socket gets, and the endpoints of a socket pair.

A link is one PUSH and one PULL socket per side. The binding side binds its PULL
socket at the endpoint it is given and its PUSH socket at the paired endpoint
(`paired_endpoint`); the connecting side does the opposite (`bind_pair`,
`connect_pair`). `configure` sets what every socket of a link gets: its queue,
linger, CURVE keys and ZeroMQ heartbeats.
"""

from __future__ import annotations

import zmq

from . import curve as curve_keys
from .curve import CurveKeys
from .endpoints import parse_tcp_endpoint

__all__ = ["paired_endpoint", "configure", "bind_pair", "connect_pair", "DEFAULT_HWM", "HEARTBEAT_TIMEOUT_SHARE"]

DEFAULT_HWM = 16
"""Messages queued per socket before a send blocks. The stages exchange messages in
lock step, so a short queue suffices and bounds memory at 16 x the largest message."""
HEARTBEAT_TIMEOUT_SHARE = 2 / 5
"""Of ``--heartbeat``: how long ZeroMQ waits for traffic after its ping, and the grace a closed connection gets.
ZeroMQ counts a message only once all of it has arrived, so no message may take longer than this to cross."""


def paired_endpoint(endpoint: str) -> str:
    """The endpoint of the peer-to-binder direction's twin: tcp port + 1, or ``-r`` appended."""
    tcp = parse_tcp_endpoint(endpoint, wildcard_port=True)
    if tcp:
        if tcp.port is None:
            raise ValueError("a wildcard tcp port has no paired endpoint; bind with port 0 instead")
        if tcp.port + 1 > 65535:
            raise ValueError(f"{endpoint}: the paired port {tcp.port + 1} is out of range")
        return tcp.with_port(tcp.port + 1)
    for scheme in ("ipc://", "inproc://"):
        if endpoint.startswith(scheme) and len(endpoint) > len(scheme):
            return endpoint + "-r"
    raise ValueError(f"unsupported endpoint {endpoint!r}: use tcp://HOST:PORT, ipc://PATH or inproc://NAME")


def configure(sock: zmq.Socket, *, linger: float, hwm: int, curve: CurveKeys | None, heartbeat: float) -> None:
    """The options every socket of a link gets, before it binds or connects."""
    sock.setsockopt(zmq.LINGER, int(linger * 1000))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if curve is not None:
        curve_keys.apply(sock, curve)
    if heartbeat > 0:
        # A PING every H/5; no answer within 2H/5 drops the connection; the transport's wait gives it 2H/5 more
        # to come back: a silent peer is noticed within about H, a closed connection within 2H/5.
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat * 1000 / 5)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat * 1000 * HEARTBEAT_TIMEOUT_SHARE)))
        sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(heartbeat * 1000 * HEARTBEAT_TIMEOUT_SHARE)))
        # A connection that never completes its ZMTP handshake (libzmq's default allows 30 s) is
        # dropped after 2H, so a silent stranger does not hold a socket's one place for long.
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1000, int(heartbeat * 1000 * 2)))


def bind_pair(pull: zmq.Socket, push: zmq.Socket, endpoint: str) -> str:
    """Bind ``pull`` at ``endpoint`` and ``push`` at its pair; returns the real endpoint.

    A tcp endpoint with port 0 binds ``pull`` to a free port and ``push`` to the port after it, retrying on a
    clash."""
    tcp = parse_tcp_endpoint(endpoint, wildcard_port=True)
    if not (tcp and tcp.port == 0):
        pull.bind(endpoint)
        push.bind(paired_endpoint(endpoint))
        return endpoint
    for _ in range(50):
        port = pull.bind_to_random_port(f"tcp://{tcp.host}", min_port=20000, max_port=60000)
        chosen = tcp.with_port(port)
        try:
            push.bind(paired_endpoint(chosen))
            return chosen
        except zmq.ZMQError:
            pull.unbind(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    raise ValueError(f"found no free pair of adjacent ports on {tcp.host}")


def connect_pair(pull: zmq.Socket, push: zmq.Socket, endpoint: str) -> str:
    """The connecting side: ``push`` to the binder's ``endpoint``, ``pull`` to its pair; returns ``endpoint``."""
    push.connect(endpoint)
    pull.connect(paired_endpoint(endpoint))
    return endpoint
