"""ZeroMQ transport: one PUSH and one PULL socket per side.

The binding side binds its PULL socket at the endpoint it is given and its PUSH
socket at the paired endpoint (`paired_endpoint`); the connecting side does the
opposite. Either side may start first: ZeroMQ reconnects in the background, and
sends block (up to the timeout) until a peer is there.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import SettingsError
from . import curve as curve_keys
from .base import WAITING_LINE_EVERY, Transport, Watch
from .curve import CurveKeys
from .endpoints import parse_tcp_endpoint
from .errors import PeerGone, ProtocolError, TransportTimeout
from .gate import BUSY, UNKNOWN_KEY, Gate
from .wire import WireLimits, frame_nbytes

__all__ = ["ZmqTransport", "paired_endpoint", "DEFAULT_HWM", "HEARTBEAT_TIMEOUT_SHARE"]

log = logging.getLogger(__name__)

DEFAULT_HWM = 16
HEARTBEAT_TIMEOUT_SHARE = 2 / 5
"""Of ``--heartbeat``: how long ZeroMQ waits for traffic after its ping, and the grace a closed connection gets.
ZeroMQ counts a message only once all of it has arrived, so no message may take longer than this to cross."""
"""Messages queued per socket before a send blocks. The stages exchange messages in
lock step, so a short queue suffices and bounds memory at 16 x the largest message."""

_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
"""What the connecting side's monitor reports (the binding side's `Gate` watches its own)."""

_GATE_CHECK_EVERY = 0.2
"""Seconds between a binding side's looks at its `Gate` while it waits to send."""

_LINK_CHECK_MS = 100
"""Milliseconds between a receive's looks at the monitors' events and the `Gate` while it waits (`_slice`): a
refusal is reported within this, a gone peer within its grace (2/5 of ``--heartbeat``) and this."""

_ZERO_COPY_BYTES = zmq.COPY_THRESHOLD
"""Frames at least this large are sent zero-copy; smaller ones are cheaper to copy."""
_MORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)
"""The send flags as plain ints: or-ing pyzmq's enum flags costs a few microseconds a message (Python's
`enum.Flag.__or__` builds a new member)."""

def _drained(monitor: zmq.Socket | None) -> list[dict[str, Any]]:
    """The events a socket monitor holds now (none for no monitor)."""
    events = []
    while monitor is not None:
        try:
            events.append(recv_monitor_message(monitor, zmq.NOBLOCK))
        except zmq.Again:
            break
    return events


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

    ``curve``: CURVE keys (`splitrl.transport.curve`); the binding side then accepts only
    the keys they authorise, the connecting side only the server key they pin.
    A binding side on tcp or ipc admits one connection per socket at a time, CURVE or not
    (`splitrl.transport.gate`): a second peer is refused, told so, and the session goes on.
    ``heartbeat`` H > 0: ZeroMQ heartbeats (ZMTP PING/PONG) drop a connection whose peer is
    silent, and a receive whose peer's connection is gone (closed, or dropped by heartbeats)
    and not back soon raises `PeerGone`: within about H in all (see the timings in __init__).
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
        self._grace = self.heartbeat * HEARTBEAT_TIMEOUT_SHARE
        self._pull = self._ctx.socket(zmq.PULL)
        self._push = self._ctx.socket(zmq.PUSH)
        for sock in (self._pull, self._push):
            sock.setsockopt(zmq.LINGER, int(linger * 1000))
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
            if curve is not None:
                curve_keys.apply(sock, curve)
            if heartbeat > 0:
                # A PING every H/5; no answer within 2H/5 drops the connection; `_wait` gives it 2H/5 more
                # to come back: a silent peer is noticed within about H, a closed connection within 2H/5.
                sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat * 1000 / 5)))
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat * 1000 * HEARTBEAT_TIMEOUT_SHARE)))
                sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(heartbeat * 1000 * HEARTBEAT_TIMEOUT_SHARE)))
                # A connection that never completes its ZMTP handshake (libzmq's default allows 30 s) is
                # dropped after 2H, so a silent stranger does not hold a socket's one place for long.
                sock.setsockopt(zmq.HANDSHAKE_IVL, max(1000, int(heartbeat * 1000 * 2)))
        self.gate = Gate(self._ctx, {"recv": (self._pull, f"{endpoint}"), "send": (self._push, "the paired port")},
                         curve) if gated else None
        # The connecting side's one connection, from its monitor: its peer is there once a ZMTP handshake has
        # succeeded (a stopped process still completes TCP connects, and a key CURVE refuses completes none)
        # and gone only after one has; a refusal by the binder's `Gate` is final.
        self._pollers: dict[tuple[int, int], zmq.Poller] = {}
        self._monitor = self._pull.get_monitor_socket(_LINK_EVENTS) if heartbeat > 0 and not bind else None
        # The sending socket's connection too, for `admitted` (a binder admits each socket's connection apart).
        self._push_monitor = self._push.get_monitor_socket(_LINK_EVENTS) if heartbeat > 0 and not bind else None
        self._push_joined = False
        self._joined = False
        # Whether a wait has liveness to look at between its slices (`_slice`): monitors, or a binder's Gate.
        self._watched = self._monitor is not None or self._push_monitor is not None or (
            self.gate is not None and heartbeat > 0)
        self._rcvtimeo = -1  # the receiving socket's RCVTIMEO as last set (-1: libzmq's default, block)
        self._early_drops = 0  # connections closed before any handshake succeeded
        self._refused: int | None = None
        self._gone_since: float | None = None
        self._holder: int | None = None  # the connection of the session's peer (a binder's `Gate` generation)
        # Frames above the limit make ZeroMQ drop the connection before we allocate them.
        self._pull.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        try:
            if bind:
                self.endpoint = self._bind(endpoint)
            else:
                self._push.connect(endpoint)
                self._pull.connect(paired_endpoint(endpoint))
                self.endpoint = endpoint
        except (zmq.ZMQError, ValueError) as exc:
            self._close()
            self._closed = True
            raise SettingsError(f"cannot {'bind' if bind else 'connect'} {endpoint}: {exc}") from exc
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
                return self._discard_rest(frame, len(frames), total)
        return frames

    def _discard_rest(self, frame: Any, count: int, total: int) -> Sequence[Any]:
        """Over the frame count or the message size: drop the message's remaining parts one by one, holding none."""
        while frame.more:
            frame = self._pull.recv(copy=False)
            count += 1
            total += len(frame.buffer)
        del frame
        raise ProtocolError(f"from {self.peer}: message of {count} frames and {total} bytes: expected at most "
                            f"{self.limits.max_tensors + 1} frames and {self.limits.max_message_bytes} bytes; "
                            "message dropped")

    def _wait(self, timeout: float) -> Any:
        """Block for the next message: give up after ``timeout``, once the peer's connection has been gone
        for its grace (2/5 of ``heartbeat``), or when the binder refused us; say every `WAITING_LINE_EVERY`
        seconds what we are waiting for.

        The wait is a blocking receive in slices (``RCVTIMEO``), liveness looked at between them: a message
        that comes is taken inside libzmq as it arrives. A non-blocking try, then ``zmq_poll``, then a
        receive (what this did before) made a 16 KiB ping-pong about 15 % slower (docs/results/transport.md)."""
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
            self._link_events()
            self._check_alive()
            now = time.monotonic()
            if now >= deadline:
                hint = ""
                if not self._joined and self._early_drops:
                    hint = (f" ({self._early_drops} connection(s) closed before a handshake completed: a peer that "
                            "is not the one expected, or with --curve a server key that is not the one pinned)")
                raise TransportTimeout(f"no message from {self.peer} within {timeout:g} s{hint}")
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
        if self._watched:
            ms = min(ms, _LINK_CHECK_MS)
        gone_since = self._gone_since  # once: a sending thread's liveness check may clear it meanwhile
        if gone_since is not None:
            ms = min(ms, max(1, int((gone_since + self._grace - time.monotonic()) * 1000) + 1))
        if ms != self._rcvtimeo:
            self._pull.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms
        return True

    def _await_room(self, deadline: float, timeout: float) -> None:
        """Block until the send queue has room; `PeerGone` as in `_wait`, `TransportTimeout` at ``deadline``."""
        poller = self._poller(self._push, zmq.POLLOUT)
        while True:
            ready = dict(poller.poll(self._poll_ms(deadline)))
            if self._monitor in ready or self._push_monitor in ready:
                self._link_events()
            if self._push in ready:
                return
            self._check_alive()
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
        for monitor in (self._monitor, self._push_monitor):
            if monitor is not None:
                poller.register(monitor, zmq.POLLIN)
        return poller

    def admitted(self, timeout: float) -> bool:
        """Connecting side (with a heartbeat): whether the binder admits both our connections (True) or refused
        one (False; this transport is then done), once it has said; `TransportTimeout` after ``timeout``."""
        if self._monitor is None or self._push_monitor is None:
            raise ValueError("admitted() is for a connecting ZmqTransport with a heartbeat (its monitors)")
        deadline = time.monotonic() + timeout
        poller = self._poller(None, 0)
        while True:
            self._link_events()
            if self._refused is not None:
                return False
            if self._joined and self._push_joined:
                return True
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"{self.peer} did not admit or refuse this connection within {timeout:g} s "
                                       "(is it running?)")
            poller.poll(self._poll_ms(deadline))

    def _poll_ms(self, until: float) -> int:
        """How long one poll may block: to ``until``, but no longer than liveness needs to look again."""
        now = time.monotonic()
        wake = until
        if self.gate is not None and self.heartbeat > 0:
            wake = min(wake, now + _GATE_CHECK_EVERY)
        gone_since = self._gone_since  # once: another thread's liveness check may clear it meanwhile
        if gone_since is not None:
            wake = min(wake, gone_since + self._grace)
        return max(0, int((wake - now) * 1000)) + 1

    def _check_alive(self) -> None:
        """`PeerGone` when the binder refused us, or when the peer's connection has been gone for the grace.
        A binder watches its `Gate` only once a session exists (before it, a connection that comes and goes
        is a stranger's) and counts a new holder of its socket as the old peer gone."""
        if self._refused is not None:
            raise PeerGone(self._refusal())
        if self.gate is not None and self.heartbeat > 0:
            if self.session is None:
                self._gone_since = None
            else:
                if self._holder is None:
                    self._holder = self.gate.holder("recv")
                elif self.gate.holder("recv") not in (None, self._holder):
                    raise PeerGone(f"{self.peer} is gone: another connection holds its place now (a restarted peer; or "
                                   f"ZeroMQ dropped a connection whose message took longer than "
                                   f"{HEARTBEAT_TIMEOUT_SHARE * self.heartbeat:g} s to arrive, 2/5 of --heartbeat: on a thin link "
                                   "give both stages a --heartbeat of 2.5 x the largest message's transfer time)")
                self._gone_since = self.gate.vacated_since("recv")
        if self._gone_since is not None and time.monotonic() >= self._gone_since + self._grace:
            raise PeerGone(f"{self.peer} is gone: its connection closed (or went silent) and it did not come "
                           f"back within {self._grace:g} s (--heartbeat {self.heartbeat:g})")

    def new_session(self) -> None:
        super().new_session()
        self._gone_since = self._holder = None
        if self.gate is not None:
            self.gate.forget()  # the lost peer's vacancy is no longer news: wait for the next one

    def _refusal(self) -> str:
        why = {UNKNOWN_KEY: "it does not authorise this side's CURVE key (its key directory's authorized/ must "
                            "hold our public key)",
               BUSY: "it is serving another peer (one session at a time; if that was us before a restart, it "
                     "notices within its --heartbeat; start both with --resume then)"}
        return f"{self.peer} refused this connection: {why.get(self._refused, f'ZAP status {self._refused}')}"

    def pending(self) -> bool:
        return bool(self._pull.poll(0, zmq.POLLIN))

    def check_alive(self) -> None:
        self._link_events()
        self._check_alive()

    @staticmethod
    def watch(links: Sequence[Transport]) -> Watch:
        if not all(isinstance(link, ZmqTransport) for link in links):
            return Watch(links)
        return _ZmqWatch(links)

    def _link_events(self) -> None:
        for event in _drained(self._monitor):
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._joined = True
                self._gone_since = None
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused = event["value"]
            elif kind == zmq.EVENT_DISCONNECTED:
                if not self._joined:
                    self._early_drops += 1
                elif self._gone_since is None:
                    self._gone_since = time.monotonic()
        for event in _drained(self._push_monitor):  # the sending socket: admitted or refused (liveness is the pull's)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._push_joined = True
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused = event["value"]

    def _close(self) -> None:
        if self.gate is not None:
            self.gate.stop()
        # Both monitors off before either reading end closes (see `Gate.stop`: libzmq's blocking monitor sends).
        for sock, monitor in ((self._pull, self._monitor), (self._push, self._push_monitor)):
            if monitor is not None:
                sock.disable_monitor()
        for monitor in (self._monitor, self._push_monitor):
            if monitor is not None:
                monitor.close()
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
