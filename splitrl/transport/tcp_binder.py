"""The binding side of a plain TCP link: its listening socket, admitting one connection at a time.

docs/PROTOCOL.md section 10: the binder's transport accepts its one peer (`TcpBinder.try_accept`); before a
session exists, that connection has an opening window (`TcpBinder.opening_deadline`) to deliver a whole
message, so a silent stranger cannot hold the only place; while a session holds the connection, a thread
answers every further one with an ``abort`` (`BUSY_REASON`) and closes it, and the session goes on.
"""

from __future__ import annotations

import logging
import math
import select
import socket
import threading
import time
from typing import Callable

from .endpoints import TcpEndpoint
from .tcp_framing import framed
from .wire import ABORT_KIND, encode

__all__ = ["TcpBinder", "BUSY_REASON", "listen"]

log = logging.getLogger(__name__)

_REFUSE_POLL_S = 0.2
"""How often a binder with a session looks for further connections to refuse."""
BUSY_REASON = ("refused: stage1 is serving another peer (one session at a time); if that was this side before a "
               "restart, stage1 notices within its --heartbeat: start this side with --resume then")
"""The ``abort`` reason a connection gets while the binder's session runs."""


def listen(host: str, port: int | None) -> socket.socket:
    """A non-blocking socket listening at ``host`` (``*``: every address) and ``port`` (0: any free one)."""
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


class TcpBinder:
    """A listening socket whose one place is taken by the connection `try_accept` returns.

    ``occupied`` says whether a session holds that place now (its connection is up and a session exists):
    only then are further connections refused, so before a session the place stays open to the next one.
    ``heartbeat`` H > 0 gives an accepted connection an opening window of 2 x H (at least 1 s).
    """

    def __init__(self, tcp: TcpEndpoint, *, heartbeat: float, occupied: Callable[[], bool]) -> None:
        self.socket = listen(tcp.address, tcp.port)
        self.endpoint = tcp.with_port(self.socket.getsockname()[1])
        """The real address (port 0 picks a free port)."""
        self.opening = max(1.0, 2 * heartbeat) if heartbeat > 0 else None
        """Seconds an accepted connection has to deliver a whole message before a session exists (None: no limit)."""
        self.accepted_at: float | None = None
        self.refused = 0
        """Connections refused while a session ran."""
        self._occupied = occupied
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._refuser = threading.Thread(target=self._refuse_others, name="tcp-refuser", daemon=True)
        self._refuser.start()

    def try_accept(self) -> socket.socket | None:
        """The next waiting connection, or None when none waits (never blocks)."""
        try:
            with self._lock:
                sock, addr = self.socket.accept()
        except BlockingIOError:
            return None
        log.debug("accepted %s on %s", addr, self.endpoint)
        self.accepted_at = time.monotonic()
        return sock

    def opening_deadline(self) -> float:
        """When the last accepted connection's opening window ends (``inf``: no window)."""
        if self.opening is None or self.accepted_at is None:
            return math.inf
        return self.accepted_at + self.opening

    def _refuse_others(self) -> None:
        """While a session holds the connection, answer every further one with an ``abort`` and close it."""
        listener = self.socket
        refusal = b"".join(framed(encode(ABORT_KIND, 0, {"reason": BUSY_REASON})))
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(int(_REFUSE_POLL_S * 1000)) or not self._occupied():
                if not self._occupied():
                    self._stop.wait(_REFUSE_POLL_S)  # the receiving thread accepts: the place is free
                continue
            try:
                with self._lock:
                    if not self._occupied():
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

    def stop(self) -> None:
        """Stop refusing (the thread ends within `_REFUSE_POLL_S`)."""
        self._stop.set()
        self._refuser.join(timeout=2)

    def close(self) -> None:
        self.stop()
        self.socket.close()
