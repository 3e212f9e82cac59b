"""ZeroMQ transport: one PUSH and one PULL socket per side.

The binding side binds its PULL socket at the endpoint it is given and its PUSH
socket at the paired endpoint (`paired_endpoint`); the connecting side does the
opposite. Either side may start first: ZeroMQ reconnects in the background, and
sends block (up to the timeout) until a peer is there.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import zmq

from .base import Transport
from .endpoints import parse_tcp_endpoint
from .errors import TransportTimeout
from .wire import WireLimits, frame_nbytes

__all__ = ["ZmqTransport", "paired_endpoint", "DEFAULT_HWM"]

log = logging.getLogger(__name__)

DEFAULT_HWM = 16
"""Messages queued per socket before a send blocks. The stages exchange messages in
lock step, so a short queue suffices and bounds memory at 16 x the largest message."""

_ZERO_COPY_BYTES = zmq.COPY_THRESHOLD
"""Frames at least this large are sent zero-copy; smaller ones are cheaper to copy."""

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


class ZmqTransport(Transport):
    """A `Transport` over a PUSH/PULL socket pair.

    ``bind=True`` for the server side. A tcp endpoint with port 0 binds the
    receiving socket to a free port and the sending socket to the port after it
    (retrying on a clash); `endpoint` then holds the real address for the peer.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool,
        timeout: float = 30.0,
        limits: WireLimits = WireLimits(),
        context: zmq.Context | None = None,
        hwm: int = DEFAULT_HWM,
        linger: float = 1.0,
        name: str = "",
    ) -> None:
        super().__init__(peer=f"peer at {endpoint}" if not name else name, timeout=timeout, limits=limits)
        self._ctx = context or zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._push = self._ctx.socket(zmq.PUSH)
        for sock in (self._pull, self._push):
            sock.setsockopt(zmq.LINGER, int(linger * 1000))
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
        # Frames above the limit make ZeroMQ drop the connection before we allocate them.
        self._pull.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        self._rcvtimeo = self._sndtimeo = None
        try:
            if bind:
                self.endpoint = self._bind(endpoint)
            else:
                self._push.connect(endpoint)
                self._pull.connect(paired_endpoint(endpoint))
                self.endpoint = endpoint
        except (zmq.ZMQError, ValueError) as exc:
            self._close()
            raise ValueError(f"cannot {'bind' if bind else 'connect'} {endpoint}: {exc}") from exc
        if not name:
            self.peer = f"peer at {self.endpoint}"

    def _bind(self, endpoint: str) -> str:
        tcp = parse_tcp_endpoint(endpoint, wildcard_port=True)
        if not (tcp and tcp.port == 0):
            self._pull.bind(endpoint)
            self._push.bind(paired_endpoint(endpoint))
            return endpoint
        for _ in range(50):
            port = self._pull.bind_to_random_port(f"tcp://{tcp.host}", min_port=20000, max_port=60000)
            chosen = tcp.with_port(port)
            try:
                self._push.bind(paired_endpoint(chosen))
                return chosen
            except zmq.ZMQError:
                self._pull.unbind(self._pull.getsockopt_string(zmq.LAST_ENDPOINT))
        raise ValueError(f"found no free pair of adjacent ports on {tcp.host}")

    def _send_frames(self, frames: list[Any], timeout: float) -> None:
        if timeout != self._sndtimeo:
            self._push.setsockopt(zmq.SNDTIMEO, max(0, int(timeout * 1000)))
            self._sndtimeo = timeout
        push, last = self._push, len(frames) - 1
        try:
            # Only the first part can block or time out: ZeroMQ queues the rest of a
            # multipart message unconditionally, so this stays atomic. One send per
            # frame skips send_multipart's per-frame type checks; small frames are
            # copied (pyzmq would copy them anyway, after building a Frame object).
            for i, frame in enumerate(frames):
                push.send(frame, zmq.SNDMORE if i < last else 0, copy=frame_nbytes(frame) < _ZERO_COPY_BYTES)
        except zmq.Again:
            raise TransportTimeout(f"could not send to {self.peer} within {timeout:g} s (is it running?)") from None

    def _recv_frames(self, timeout: float) -> Sequence[Any]:
        if timeout != self._rcvtimeo:
            self._pull.setsockopt(zmq.RCVTIMEO, max(0, int(timeout * 1000)))
            self._rcvtimeo = timeout
        pull = self._pull
        try:
            frame = pull.recv(copy=False)
        except zmq.Again:
            raise TransportTimeout(f"no message from {self.peer} within {timeout:g} s") from None
        # The other parts are already here: ZeroMQ delivers a multipart message whole.
        # Frame.more instead of recv_multipart's getsockopt(RCVMORE) (~3 us a part);
        # memoryviews so decode never hits zmq.Frame's slow attribute hook.
        frames = [memoryview(frame)]
        while frame.more:
            frame = pull.recv(copy=False)
            frames.append(memoryview(frame))
        return frames

    def _close(self) -> None:
        self._pull.close()
        self._push.close()
