"""Plain TCP transport: one full-duplex connection carrying the frames of `wire.encode`.

Plain TCP framing (docs/PROTOCOL.md): every message is a little-endian u32 frame
count, then for each frame a little-endian u64 byte length followed by exactly that
many bytes. The frames are the same as ZmqTransport's; nothing else is ever sent
(no handshake of its own, no padding, no trailer).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Sequence

from ..errors import SettingsError
from .base import WAITING_LINE_EVERY, Transport
from .endpoints import require_tcp_endpoint
from .errors import PeerGone, ProtocolError, TransportTimeout
from .wire import ABORT_KIND, WireLimits, encode

__all__ = ["TcpTransport", "PeerGone", "BUSY_REASON"]

log = logging.getLogger(__name__)

_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_COUNT_AND_LENGTH = struct.Struct("<IQ")
try:
    _IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
    _IOV_MAX = 16
# Python ignores SIGPIPE already; the flag keeps that true inside embedding hosts too.
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_STAGING_BYTES = 256 * 1024
"""Small frames and length prefixes are read through this buffer, many per syscall."""
_DIRECT_BYTES = 64 * 1024
"""A frame remainder at least this large is read straight into its own buffer."""
_UPFRONT_BYTES = 4 * 1024 * 1024
"""A frame's buffer starts at most this large and doubles as its bytes arrive, so a peer that announces a
large frame and sends little costs little."""
_RETRY_CONNECT_S = 0.05
_REFUSE_POLL_S = 0.2
"""How often a binder with a session looks for further connections to refuse."""
BUSY_REASON = ("refused: stage1 is serving another peer (one session at a time); if that was this side before a "
               "restart, stage1 notices within its --heartbeat: start this side with --resume then")
"""The ``abort`` reason a connection gets while the binder's session runs."""


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
        self._listener: socket.socket | None = None
        self._sock: socket.socket | None = None
        self._pollers: dict[int, select.poll] = {}
        self._addrs: list[tuple[socket.AddressFamily, Any]] = []
        self._staging = bytearray(_STAGING_BYTES)
        self._sview = memoryview(self._staging)
        self._rpos = self._rend = 0
        self._reset_message()
        self._accepted_at: float | None = None
        self._opening = max(1.0, 2 * self.heartbeat) if self.heartbeat > 0 else None
        self._accept_lock = threading.Lock()
        self._stop = threading.Event()
        self._refuser: threading.Thread | None = None
        self.refused = 0
        """Connections refused while a session ran."""
        try:
            if bind:
                self._listener = self._listen(host, port)
                port = self._listener.getsockname()[1]
                self.endpoint = tcp.with_port(port)
                self._refuser = threading.Thread(target=self._refuse_others, name="tcp-refuser", daemon=True)
                self._refuser.start()
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

    # -- connection management ----------------------------------------------------
    @staticmethod
    def _listen(host: str, port: int) -> socket.socket:
        infos = socket.getaddrinfo(
            None if host == "*" else host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # Lets a restarted stage rebind a port still in TIME_WAIT; Linux still refuses two listeners.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(1)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

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
        assert self._listener is not None
        while True:
            try:
                with self._accept_lock:
                    sock, addr = self._listener.accept()
                log.debug("accepted %s on %s", addr, self.endpoint)
                self._accepted_at = time.monotonic()
                return sock
            except BlockingIOError:
                pass
            if not self._poll(self._listener, select.POLLIN, deadline, f"{self.peer} to connect to {self.endpoint}"):
                raise TransportTimeout(
                    f"could not {doing} {self.peer} within {timeout:g} s: no peer connected to {self.endpoint}"
                )

    def new_session(self) -> None:
        super().new_session()
        self._drop()  # whoever holds the connection now is not the next session's peer until it says hello

    def _drop_stranger(self) -> None:
        self._drop()

    def _refuse_others(self) -> None:
        """While a session holds the connection, answer every further one with an ``abort`` and close it."""
        listener = self._listener
        assert listener is not None
        refusal = b"".join(_framed(encode(ABORT_KIND, 0, {"reason": BUSY_REASON})))
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(int(_REFUSE_POLL_S * 1000)) or self._sock is None or self.session is None:
                if self._sock is None or self.session is None:
                    self._stop.wait(_REFUSE_POLL_S)  # the receiving thread accepts: the place is free
                continue
            try:
                with self._accept_lock:
                    if self._sock is None or self.session is None:
                        continue
                    other, addr = listener.accept()
            except (BlockingIOError, OSError):
                continue
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood cannot flood the log
                log.warning("refused a connection from %s to %s: the session's peer holds it (one at a time; "
                            "the session goes on; %d refused so far)", addr, self.endpoint, self.refused)
            try:
                other.settimeout(1.0)
                other.sendall(refusal)
            except OSError:
                pass
            finally:
                other.close()

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
        self._rpos = self._rend = 0
        self._reset_message()

    def _gone(self, detail: str = "") -> PeerGone:
        partial = self._partial_bytes() + (self._rend - self._rpos)
        self._drop()
        where = f" in the middle of a message ({partial} bytes of it received)" if partial else ""
        return PeerGone(f"{self.peer} closed the connection{where}{detail}")

    # -- sending --------------------------------------------------------------------
    def _send_frames(self, frames: list[Any], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        sock = self._connection(deadline, timeout, "send to")
        views = [_byte_view(f) for f in frames]
        buffers: list[Any] = [_COUNT_AND_LENGTH.pack(len(views), len(views[0])) if views else _COUNT.pack(0)]
        for i, view in enumerate(views):
            if i:
                buffers.append(_LENGTH.pack(len(view)))
            if len(view):
                buffers.append(view)
        total = sum(len(b) for b in buffers)
        sent = 0
        first = 0
        while first < len(buffers):
            try:
                n = sock.sendmsg(buffers[first : first + _IOV_MAX], (), _SEND_FLAGS)
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
    def _reset_message(self) -> None:
        self._nframes: int | None = None
        self._frames: list[bytearray] = []
        self._current: memoryview | None = None
        self._filled = 0
        self._want = 0
        self._message_bytes = 0

    def _partial_bytes(self) -> int:
        if self._nframes is None:
            return 0
        done = self._frames[:-1] if self._current is not None else self._frames
        return _COUNT.size + _LENGTH.size * len(self._frames) + sum(map(len, done)) + (self._filled if self._current is not None else 0)

    def _out_of_sync(self, what: str, expected: str, got: str) -> ProtocolError:
        self._drop()
        return ProtocolError(
            f"from {self.peer}: {what}: expected {expected}, got {got}; "
            "the byte stream is out of sync, connection dropped"
        )

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
                partial = self._partial_bytes() + (self._rend - self._rpos)
                kept = f" ({partial} bytes of a message kept for the next recv)" if partial else ""
                raise TransportTimeout(f"no message from {self.peer} within {timeout:g} s{kept}")

    def _fill(self, sock: socket.socket, deadline: float, timeout: float) -> None:
        # Frame bytes are consumed as soon as they arrive, so what is left here is at
        # most a partial length prefix (< 8 bytes): moving it to the front is cheap.
        left = self._rend - self._rpos
        if self._rpos:
            self._staging[:left] = bytes(self._sview[self._rpos : self._rend])
            self._rpos, self._rend = 0, left
        self._rend += self._read_into(sock, self._sview[self._rend :], deadline, timeout)

    def _recv_frames(self, timeout: float) -> Sequence[Any]:
        deadline = time.monotonic() + timeout
        sock = self._connection(deadline, timeout, "receive from")
        opening = self._accepted_at + self._opening if (
            self._binding and self.session is None and self._opening is not None and self._accepted_at is not None
        ) else math.inf
        if opening >= deadline:
            return self._receive(sock, deadline, timeout)
        try:
            return self._receive(sock, opening, timeout)
        except TransportTimeout:
            self._drop()
            raise ProtocolError(
                f"a connection to {self.endpoint} sent no whole message within {self._opening:g} s of connecting: "
                "dropped (one connection at a time; the next one is accepted)"
            ) from None

    def _receive(self, sock: socket.socket, deadline: float, timeout: float) -> Sequence[Any]:
        limits = self.limits
        while True:
            avail = self._rend - self._rpos
            current = self._current
            if current is not None:
                need = len(current) - self._filled
                if avail:
                    n = min(need, avail)
                    current[self._filled : self._filled + n] = self._sview[self._rpos : self._rpos + n]
                    self._rpos += n
                    self._filled += n
                elif need >= _DIRECT_BYTES:
                    self._filled += self._read_into(sock, current[self._filled :], deadline, timeout)
                else:
                    self._fill(sock, deadline, timeout)
                if self._filled == len(current):
                    if self._filled < self._want:  # the bytes so far have come: make room for as many more
                        frame = self._frames[-1]
                        current.release()
                        frame.extend(bytes(min(self._want, 2 * len(frame)) - len(frame)))
                        self._current = memoryview(frame)
                    else:
                        self._current = None
                continue
            if self._nframes is None:
                if avail < _COUNT.size:
                    self._fill(sock, deadline, timeout)
                    continue
                (count,) = _COUNT.unpack_from(self._staging, self._rpos)
                if not 1 <= count <= limits.max_tensors + 1:
                    raise self._out_of_sync(
                        "frame count", f"1 to {limits.max_tensors + 1} (header + at most {limits.max_tensors} tensors)", str(count)
                    )
                self._rpos += _COUNT.size
                self._nframes = count
                continue
            if len(self._frames) == self._nframes:
                frames = self._frames
                self._reset_message()
                return frames
            if avail < _LENGTH.size:
                self._fill(sock, deadline, timeout)
                continue
            (length,) = _LENGTH.unpack_from(self._staging, self._rpos)
            index = len(self._frames)
            cap = limits.max_header_bytes if index == 0 else limits.max_tensor_bytes
            if length > cap:
                what = "header frame length" if index == 0 else f"frame #{index} length"
                raise self._out_of_sync(what, f"at most {cap} bytes", f"{length} bytes")
            if self._message_bytes + length > limits.max_message_bytes:
                raise self._out_of_sync(
                    "message size", f"at most {limits.max_message_bytes} bytes", f"more than {self._message_bytes + length} bytes"
                )
            self._rpos += _LENGTH.size
            self._message_bytes += length
            # A fresh bytearray per frame: writable and malloc-aligned, so decode can wrap it without a copy.
            frame = bytearray(min(length, _UPFRONT_BYTES))
            self._frames.append(frame)
            self._want = length
            if length:
                self._current = memoryview(frame)
                self._filled = 0

    def _close(self) -> None:
        self._stop.set()
        if self._refuser is not None:
            self._refuser.join(timeout=2)
        self._drop()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _framed(frames: Sequence[Any]) -> list[bytes]:
    """One message in the plain TCP framing, as the buffers to write (docs/PROTOCOL.md section 10)."""
    out = [_COUNT.pack(len(frames))]
    for frame in frames:
        view = _byte_view(frame)
        out += [_LENGTH.pack(len(view)), bytes(view)]
    return out


def _byte_view(frame: Any) -> memoryview:
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
