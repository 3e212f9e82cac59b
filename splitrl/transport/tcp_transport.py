"""Plain TCP transport: one full-duplex connection carrying the frames of `wire.encode`.

Plain TCP framing (docs/PROTOCOL.md section 10): every message is a little-endian u32 frame
count, then for each frame a little-endian u64 byte length followed by exactly that
many bytes. The frames are the same as ZmqTransport's; nothing else is ever sent
(no handshake of its own, no padding, no trailer). The framing itself, both ways, is
`splitrl.transport.tcp_framing`'s; the binder's listening socket (one connection at a
time) is `splitrl.transport.tcp_binder`'s. This module holds the connection: accepting
or dialling it, keepalive, sending, and the timeouts and losses of both directions.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import socket
import time
from typing import Any, Sequence

from ..errors import SettingsError
from .base import WAITING_LINE_EVERY, Transport
from .endpoints import require_tcp_endpoint
from .errors import PeerGone, ProtocolError, TransportTimeout
from .tcp_binder import BUSY_REASON, TcpBinder
from .tcp_framing import IOV_MAX, SEND_FLAGS, FrameReader, OutOfSync, message_buffers
from .wire import WireLimits

__all__ = ["TcpTransport", "PeerGone", "BUSY_REASON"]

log = logging.getLogger(__name__)

_RETRY_CONNECT_S = 0.05


class TcpTransport(Transport):
    """A `Transport` over one plain TCP connection (see the module docstring for the framing).

    ``bind=True`` listens at ``endpoint`` (port 0 picks a free port; `endpoint`
    then holds the real address) and accepts exactly one peer, lazily: on the
    first send or recv, within that call's timeout. ``bind=False`` connects on
    first use and retries until the timeout, so either side may start first.

    One connection at a time (docs/PROTOCOL.md section 10): before a session
    exists (`Transport.session`), a connection that has not delivered a whole
    message within its opening window (2 x ``heartbeat``, at least 1 s) is
    dropped as a stranger's and the next one accepted, so a silent connection
    cannot hold the only place; while a session runs, every further connection
    is answered with an ``abort`` (`BUSY_REASON`) and closed, and the session
    goes on. ``heartbeat`` H > 0 also sets TCP keepalive (a dead host is noticed
    within about H; a killed process closes its connection at once).

    Timeouts: a recv that times out in the middle of a message keeps what has
    arrived and the next recv continues it. A send that times out before any
    byte left raises `TransportTimeout` and the connection stays usable; one
    that times out part-way has put half a message on the stream, so the
    connection is dropped as well.

    Framing errors: a frame count or frame length beyond ``limits`` (checked
    before anything is allocated) raises `ProtocolError`. The byte stream is
    then out of sync, so unlike a message that merely fails to decode, the
    connection is dropped: the binding side accepts a new peer on the next
    call, the connecting side reconnects. A peer that closes the connection
    raises `PeerGone`, never a hang; the same reconnect rules apply.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool,
        timeout: float = 30.0,
        limits: WireLimits = WireLimits(),
        name: str = "",
        heartbeat: float = 0.0,
    ) -> None:
        super().__init__(peer=name or f"peer at {endpoint}", timeout=timeout, limits=limits)
        self.heartbeat = float(heartbeat)
        tcp = require_tcp_endpoint(endpoint, "TcpTransport")
        host, port = tcp.address, tcp.port
        self._binding = bind
        self._binder: TcpBinder | None = None
        self._sock: socket.socket | None = None
        self._pollers: dict[int, select.poll] = {}
        self._addrs: list[tuple[socket.AddressFamily, Any]] = []
        self._reader = FrameReader()
        try:
            if bind:
                self._binder = TcpBinder(tcp, heartbeat=self.heartbeat, occupied=self._occupied)
                self.endpoint = self._binder.endpoint
            else:
                if host == "*":
                    raise SettingsError("cannot connect to the wildcard host '*'")
                # Resolved once, so a typo fails here rather than after a timeout.
                self._addrs = [(info[0], info[4]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
                self.endpoint = endpoint
        except (OSError, ValueError) as exc:
            self._close()
            raise SettingsError(f"cannot {'bind' if bind else 'connect'} {endpoint}: {exc}") from exc
        if not name:
            self.peer = f"peer at {self.endpoint}"

    @property
    def refused(self) -> int:
        """Connections refused while a session ran."""
        return self._binder.refused if self._binder is not None else 0

    def _occupied(self) -> bool:
        """Whether a session holds the one connection (the binder then refuses others)."""
        return self._sock is not None and self.session is not None

    # -- connection management ----------------------------------------------------
    def _connection(self, deadline: float, timeout: float, doing: str) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = self._accept(deadline, timeout, doing) if self._binding else self._connect(deadline, timeout, doing)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.heartbeat > 0:
            # TCP keepalive probes as the heartbeat: a peer silent for about ``heartbeat`` seconds (host gone,
            # cable pulled) resets the connection, which the next receive reports as `PeerGone`.
            probe = max(1, round(self.heartbeat / 3))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, probe)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, probe)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(self.heartbeat * 1000)))
        self._sock = sock
        self._pollers = {}
        log.debug("connected to %s (%s)", self.peer, "accepted" if self._binding else "dialled")
        return sock

    def _accept(self, deadline: float, timeout: float, doing: str) -> socket.socket:
        binder = self._binder
        assert binder is not None
        while True:
            sock = binder.try_accept()
            if sock is not None:
                return sock
            if not self._poll(binder.socket, select.POLLIN, deadline, f"{self.peer} to connect to {self.endpoint}"):
                raise TransportTimeout(
                    f"could not {doing} {self.peer} within {timeout:g} s: no peer connected to {self.endpoint}"
                )

    def new_session(self) -> None:
        super().new_session()
        self._drop()  # whoever holds the connection now is not the next session's peer until it says hello

    def _drop_stranger(self) -> None:
        self._drop()

    def _connect(self, deadline: float, timeout: float, doing: str) -> socket.socket:
        last: OSError | None = None
        start = time.monotonic()
        next_line = start + WAITING_LINE_EVERY
        while True:
            for family, addr in self._addrs:
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                err = sock.connect_ex(addr)
                if err in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
                    if self._poll(sock, select.POLLOUT, deadline, self.peer):
                        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    else:
                        err = errno.ETIMEDOUT
                if err == 0:
                    return sock
                sock.close()
                last = OSError(err, os.strerror(err))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeout(
                    f"could not {doing} {self.peer} within {timeout:g} s: cannot connect ({last}; is it running?)"
                )
            now = time.monotonic()
            if now >= next_line:
                log.info("waiting for %s to accept: %.0f s so far (giving up after %.0f s)", self.peer, now - start,
                         deadline - start)
                next_line = now + WAITING_LINE_EVERY
            time.sleep(min(_RETRY_CONNECT_S, remaining))

    def _poll(self, sock: socket.socket, events: int, deadline: float, waiting_for: str = "") -> bool:
        """Wait until ``sock`` is ready for ``events``; False once ``deadline`` passes. With ``waiting_for``, a
        line every `WAITING_LINE_EVERY` seconds says what the wait is for."""
        poller = self._pollers.get(events) if sock is self._sock else None
        if poller is None:
            poller = select.poll()
            poller.register(sock, events)
            if sock is self._sock:
                self._pollers[events] = poller
        start = time.monotonic()
        next_line = start + WAITING_LINE_EVERY if waiting_for else math.inf
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return False
            if now >= next_line:
                log.info("waiting for %s: %.0f s so far (giving up after %.0f s)", waiting_for, now - start,
                         deadline - start)
                next_line = now + WAITING_LINE_EVERY
            # Round up: poll(0) would spin for the last fraction of a millisecond.
            if poller.poll(math.ceil(min(remaining, next_line - now) * 1000)):
                return True

    def _drop(self) -> None:
        """Forget the connection and any partial message: the stream can no longer be trusted."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._pollers = {}
        self._reader.reset()

    def _gone(self, detail: str = "") -> PeerGone:
        partial = self._reader.buffered()
        self._drop()
        where = f" in the middle of a message ({partial} bytes of it received)" if partial else ""
        return PeerGone(f"{self.peer} closed the connection{where}{detail}")

    # -- sending --------------------------------------------------------------------
    def _send_frames(self, frames: list[Any], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        sock = self._connection(deadline, timeout, "send to")
        buffers = message_buffers(frames)
        total = sum(len(b) for b in buffers)
        sent = 0
        first = 0
        while first < len(buffers):
            try:
                n = sock.sendmsg(buffers[first : first + IOV_MAX], (), SEND_FLAGS)
            except BlockingIOError:
                n = 0
            except InterruptedError:
                n = 0
            except OSError as exc:  # closed, reset, or keepalive found the host gone (ETIMEDOUT)
                raise self._gone(f" ({exc.strerror or exc}) while we sent {sent} of {total} bytes") from None
            sent += n
            # Skip what went out; a buffer sent in part continues from a slice (no copy).
            while n:
                size = len(buffers[first])
                if n >= size:
                    n -= size
                    first += 1
                else:
                    buffers[first] = memoryview(buffers[first])[n:]
                    n = 0
            if first < len(buffers) and sent < total and not self._poll(sock, select.POLLOUT, deadline):
                if sent == 0:
                    raise TransportTimeout(f"could not send to {self.peer} within {timeout:g} s (is it reading?)")
                self._drop()
                raise TransportTimeout(
                    f"could not send to {self.peer} within {timeout:g} s: {sent} of {total} bytes of the message "
                    "went out, so the stream is out of sync and the connection was dropped"
                )

    # -- receiving ------------------------------------------------------------------
    def _read_into(self, sock: socket.socket, view: memoryview, deadline: float, timeout: float) -> int:
        while True:
            try:
                n = sock.recv_into(view)
            except BlockingIOError:
                n = -1
            except InterruptedError:
                n = -1
            except OSError as exc:  # reset, or keepalive found the host gone (ETIMEDOUT)
                raise self._gone(f" ({exc.strerror or exc})") from None
            if n > 0:
                return n
            if n == 0:
                raise self._gone()
            if not self._poll(sock, select.POLLIN, deadline, self.peer):
                partial = self._reader.buffered()
                kept = f" ({partial} bytes of a message kept for the next recv)" if partial else ""
                raise TransportTimeout(f"no message from {self.peer} within {timeout:g} s{kept}")

    def _recv_frames(self, timeout: float) -> Sequence[Any]:
        deadline = time.monotonic() + timeout
        sock = self._connection(deadline, timeout, "receive from")
        binder = self._binder
        opening = binder.opening_deadline() if binder is not None and self.session is None else math.inf
        if opening >= deadline or binder is None:
            return self._receive(sock, deadline, timeout)
        try:
            return self._receive(sock, opening, timeout)
        except TransportTimeout:
            self._drop()
            raise ProtocolError(
                f"a connection to {self.endpoint} sent no whole message within {binder.opening:g} s of connecting: "
                "dropped (one connection at a time; the next one is accepted)"
            ) from None

    def _receive(self, sock: socket.socket, deadline: float, timeout: float) -> Sequence[Any]:
        try:
            return self._reader.read(lambda view: self._read_into(sock, view, deadline, timeout), self.limits)
        except OutOfSync as bad:
            self._drop()
            raise ProtocolError(
                f"from {self.peer}: {bad}; the byte stream is out of sync, connection dropped"
            ) from None

    def _close(self) -> None:
        if self._binder is not None:
            self._binder.stop()
        self._drop()
        if self._binder is not None:
            self._binder.close()
            self._binder = None
