"""ZeroMQ transport: one PUSH and one PULL socket per side.

The binding side binds its PULL socket at the endpoint it is given and its PUSH
socket at the paired endpoint (`paired_endpoint`); the connecting side does the
opposite. Either side may start first: ZeroMQ reconnects in the background, and
sends block (up to the timeout) until a peer is there. The sockets' setup is
`splitrl.transport.zmq_sockets`'s, the peer's liveness `splitrl.transport.zmq_liveness`'s;
this module moves the messages and waits.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import zmq

from ..allocator import giving_back
from ..errors import SettingsError
from .base import WAITING_LINE_EVERY, Transport, Watch
from .curve import CurveKeys
from .errors import ProtocolError, TransportTimeout
from .gate import Gate
from .wire import WireLimits, frame_nbytes
from .zmq_liveness import Liveness
from .zmq_sockets import DEFAULT_HWM, HEARTBEAT_TIMEOUT_SHARE, bind_pair, configure, connect_pair, paired_endpoint

__all__ = ["ZmqTransport", "paired_endpoint", "DEFAULT_HWM", "HEARTBEAT_TIMEOUT_SHARE"]

log = logging.getLogger(__name__)

_LINK_CHECK_MS = 100
"""Milliseconds between a receive's looks at the monitors' events and the `Gate` while it waits (`_slice`): a
refusal is reported within this, a gone peer within its grace (2/5 of ``--heartbeat``) and this."""

_ZERO_COPY_BYTES = zmq.COPY_THRESHOLD
"""Frames at least this large are sent zero-copy; smaller ones are cheaper to copy."""
_MORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)
"""The send flags as plain ints: or-ing pyzmq's enum flags costs a few microseconds a message (Python's
`enum.Flag.__or__` builds a new member)."""


class ZmqTransport(Transport):
    """A `Transport` over a PUSH/PULL socket pair.

    ``bind=True`` for the server side. A tcp endpoint with port 0 binds the
    receiving socket to a free port and the sending socket to the port after it
    (retrying on a clash); `endpoint` then holds the real address for the peer.

    ``curve``: CURVE keys (`splitrl.transport.curve`); the binding side then accepts only
    the keys they authorise, the connecting side only the server key they pin.
    A binding side on tcp or ipc admits one connection per socket at a time, CURVE or not
    (`splitrl.transport.gate`): a second peer is refused, told so, and the session goes on.
    ``heartbeat`` H > 0: ZeroMQ heartbeats (ZMTP PING/PONG) drop a connection whose peer is
    silent, and a receive whose peer's connection is gone (closed, or dropped by heartbeats)
    and not back soon raises `PeerGone`: within about H in all (the timings: `zmq_sockets.configure`).
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
        curve: CurveKeys | None = None,
        heartbeat: float = 0.0,
    ) -> None:
        super().__init__(peer=f"peer at {endpoint}" if not name else name, timeout=timeout, limits=limits)
        if curve is not None and curve.is_server != bind:
            raise SettingsError(f"--curve: the {'server' if curve.is_server else 'client'} keys on the "
                                f"{'binding' if bind else 'connecting'} side")
        # A binding side on tcp or ipc admits connections through its `Gate` (ZAP is per context: a context of
        # its own); an inproc link stays inside this process and shares the caller's context.
        gated = bind and (curve is not None or not endpoint.startswith("inproc://"))
        self._own_ctx = zmq.Context() if gated or curve is not None else None
        self._ctx = self._own_ctx or context or zmq.Context.instance()
        self.heartbeat = float(heartbeat)
        self._pull = self._ctx.socket(zmq.PULL)
        self._push = self._ctx.socket(zmq.PUSH)
        for sock in (self._pull, self._push):
            configure(sock, linger=linger, hwm=hwm, curve=curve, heartbeat=heartbeat)
        self.gate = Gate(self._ctx, {"recv": (self._pull, f"{endpoint}"), "send": (self._push, "the paired port")},
                         curve) if gated else None
        self._pollers: dict[tuple[int, int], zmq.Poller] = {}
        self._live = Liveness(self._pull, self._push, heartbeat=self.heartbeat, bind=bind, gate=self.gate)
        self._rcvtimeo = -1  # the receiving socket's RCVTIMEO as last set (-1: libzmq's default, block)
        # Frames above the limit make ZeroMQ drop the connection before we allocate them.
        self._pull.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        try:
            self.endpoint = (bind_pair if bind else connect_pair)(self._pull, self._push, endpoint)
        except (zmq.ZMQError, ValueError) as exc:
            self._close()
            self._closed = True
            raise SettingsError(f"cannot {'bind' if bind else 'connect'} {endpoint}: {exc}") from exc
        if not name:
            self.peer = f"peer at {self.endpoint}"

    def _send_frames(self, frames: list[Any], timeout: float) -> None:
        push, last = self._push, len(frames) - 1
        # Only the first part can block: ZeroMQ queues the rest of a multipart message unconditionally, so
        # this stays atomic. While there is no room, liveness is watched as in a receive (`_await_room`).
        # One send per frame skips send_multipart's per-frame type checks; small frames are copied (pyzmq
        # would copy them anyway, after building a Frame object).
        deadline = None
        while True:
            try:
                push.send(frames[0], (_MORE if last else 0) | _NOBLOCK,
                          copy=frame_nbytes(frames[0]) < _ZERO_COPY_BYTES)
                break
            except zmq.Again:
                deadline = deadline or time.monotonic() + timeout
                self._await_room(deadline, timeout)
        for i in range(1, last + 1):
            push.send(frames[i], _MORE if i < last else 0, copy=frame_nbytes(frames[i]) < _ZERO_COPY_BYTES)

    def _recv_frames(self, timeout: float) -> Sequence[Any]:
        pull = self._pull
        frame = self._wait(timeout)
        # The other parts are already here: ZeroMQ delivers a multipart message whole.
        # Frame.more instead of recv_multipart's getsockopt(RCVMORE) (~3 us a part);
        # memoryviews so decode never hits zmq.Frame's slow attribute hook.
        frames = [memoryview(frame)]
        if not frame.more:
            return frames
        limit, total = self.limits.max_tensors + 1, len(frames[0])
        while frame.more:
            frame = pull.recv(copy=False)
            frames.append(memoryview(frame))
            total += len(frames[-1])
            if len(frames) > limit or total > self.limits.max_message_bytes:
                count, more = len(frames), frame.more
                with giving_back():  # what libzmq held, to the kernel (the stages' allocator keeps freed memory)
                    del frames, frame
                    count, total = self._drop_rest(more, count, total)
                raise ProtocolError(f"from {self.peer}: message of {count} frames and {total} bytes: expected at "
                                    f"most {limit} frames and {self.limits.max_message_bytes} bytes; message dropped")
        return frames

    def _drop_rest(self, more: bool, count: int, total: int) -> tuple[int, int]:
        """Over the frame count or the message size: drop the message's remaining parts one by one, holding none;
        returns the message's frames and bytes."""
        while more:
            frame = self._pull.recv(copy=False)
            count, total, more = count + 1, total + len(frame.buffer), frame.more
            del frame
        return count, total

    def _wait(self, timeout: float) -> Any:
        """Block for the next message: give up after ``timeout``, once the peer's connection has been gone
        for its grace (2/5 of ``heartbeat``), or when the binder refused us; say every `WAITING_LINE_EVERY`
        seconds what we are waiting for.

        The wait is a blocking receive in slices (``RCVTIMEO``), liveness looked at between them: a message
        that comes is taken inside libzmq as it arrives, cheaper than a poll followed by a receive
        (docs/benchmarks/transport.md)."""
        pull = self._pull
        start = now = time.monotonic()
        deadline = start + timeout
        next_line = start + WAITING_LINE_EVERY
        while True:
            try:
                if self._slice(min(deadline, next_line) - now):
                    return pull.recv(copy=False)
                return pull.recv(_NOBLOCK, copy=False)  # no time left: only what is here already
            except zmq.Again:
                pass
            self.check_alive()
            now = time.monotonic()
            if now >= deadline:
                raise TransportTimeout(f"no message from {self.peer} within {timeout:g} s{self._live.timeout_hint()}")
            if now >= next_line:
                log.info("waiting for %s: %.0f s so far (giving up after %.0f s)", self.peer, now - start, timeout)
                next_line = now + WAITING_LINE_EVERY

    def _slice(self, seconds: float) -> bool:
        """Set the receiving socket's timeout to one slice of a wait of ``seconds`` (rounded up to a millisecond):
        at most `_LINK_CHECK_MS` while liveness has something to look at, and no longer than the grace of a
        connection that is gone. Set only when it changes (a socket option is a call into libzmq); False when
        nothing is left to wait."""
        if seconds <= 0:
            return False
        ms = int(seconds * 1000) + 1
        live = self._live
        if live.watched:
            ms = min(ms, _LINK_CHECK_MS)
        gone_since = live.gone_since  # once: a sending thread's liveness check may clear it meanwhile
        if gone_since is not None:
            ms = min(ms, max(1, int((gone_since + live.grace - time.monotonic()) * 1000) + 1))
        if ms != self._rcvtimeo:
            self._pull.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms
        return True

    def _await_room(self, deadline: float, timeout: float) -> None:
        """Block until the send queue has room; `PeerGone` as in `_wait`, `TransportTimeout` at ``deadline``."""
        live, poller = self._live, self._poller(self._push, zmq.POLLOUT)
        while True:
            ready = dict(poller.poll(live.poll_ms(deadline)))
            if live.monitor in ready or live.push_monitor in ready:
                live.drain()
            if self._push in ready:
                return
            live.check(self.peer, self.session)
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"could not send to {self.peer} within {timeout:g} s (is it running?)")

    def _poller(self, sock: zmq.Socket | None, event: int) -> zmq.Poller:
        """A poller over ``sock`` for ``event`` and the monitors; made once per (socket, event): a receive
        that has to wait should not pay for registering three sockets every time."""
        key = (id(sock), event)
        cached = self._pollers.get(key)
        if cached is not None:
            return cached
        poller = self._pollers[key] = zmq.Poller()
        if sock is not None:
            poller.register(sock, event)
        self._live.register(poller)
        return poller

    def admitted(self, timeout: float) -> bool:
        """Connecting side (with a heartbeat): whether the binder admits both our connections (True) or refused
        one (False; this transport is then done), once it has said; `TransportTimeout` after ``timeout``."""
        live = self._live
        if live.monitor is None or live.push_monitor is None:
            raise ValueError("admitted() is for a connecting ZmqTransport with a heartbeat (its monitors)")
        deadline = time.monotonic() + timeout
        poller = self._poller(None, 0)
        while True:
            live.drain()
            if live.refused is not None:
                return False
            if live.joined and live.push_joined:
                return True
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"{self.peer} did not admit or refuse this connection within {timeout:g} s "
                                       "(is it running?)")
            poller.poll(live.poll_ms(deadline))

    def new_session(self) -> None:
        super().new_session()
        self._live.forget()

    def pending(self) -> bool:
        return bool(self._pull.poll(0, zmq.POLLIN))

    def check_alive(self) -> None:
        self._live.drain()
        self._live.check(self.peer, self.session)

    @staticmethod
    def watch(links: Sequence[Transport]) -> Watch:
        if not all(isinstance(link, ZmqTransport) for link in links):
            return Watch(links)
        return _ZmqWatch(links)

    def _close(self) -> None:
        if self.gate is not None:
            self.gate.stop()
        self._live.close()
        self._pull.close()
        self._push.close()
        if self._own_ctx is not None:
            self._own_ctx.term()


class _ZmqWatch(Watch):
    """`Watch` for ZeroMQ links: one poll over their receiving sockets, registered once."""

    def __init__(self, links: Sequence[Transport]) -> None:
        super().__init__(links)
        self._poller = zmq.Poller()
        self._index: dict[Any, int] = {}
        for i, link in enumerate(self.links):
            self._poller.register(link._pull, zmq.POLLIN)  # type: ignore[attr-defined]
            self._index[link._pull] = i  # type: ignore[attr-defined]

    def wait(self, timeout: float) -> list[int]:
        return sorted(self._index[sock] for sock, _ in self._poller.poll(max(0, round(timeout * 1000))))
