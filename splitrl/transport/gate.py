"""Who gets a connection to a binding ZeroMQ socket: one peer at a time, and with CURVE only a key we know.

libzmq asks the context's ZAP handler (ZeroMQ RFC 27) about every new connection once
its ZMTP greeting (NULL security) or its CURVE handshake is through, and before any of
its messages can reach the socket. The `Gate` is that handler for one binding transport,
with one ZAP domain per socket. It answers:

- 400 when CURVE is on and the client's public key is not among the authorised ones;
- 500 when the socket is held by an admitted connection (PUSH
  would round-robin our messages to a second stage0, PULL would mix its frames into the
  session's). ZAP's 300 ("temporary") would fit better, but libzmq 4.3 leaves such a
  connection half-open instead of closing it, so the refusal would never reach the client;
- 200 otherwise: the connection holds the socket until it closes (see below for when
  that is noticed).

A refused client's libzmq reports ``EVENT_HANDSHAKE_FAILED_AUTH`` with the code and does
not reconnect; `ZmqTransport` turns that into an error saying why. Refusals are logged
(once per reason and address or key, up to 1000 of them) and counted, and the session goes on.

The same thread reads the sockets' monitors (accepted and closed connections), which is
what tells the transport when the holder of the receiving socket has gone, or was replaced
by a new connection (its liveness check). A ZAP request does not say which connection asks
(its address is the peer's IP, no port), so an admission cannot name the holder's socket
when several connections await an answer (two edges reaching for one place together): the
holder is then "one of these", and the place is vacated when the last of them has closed.
The others close soon: a refused peer at once, a stranger that never greets at libzmq's
handshake timeout (`ZmqTransport` sets 2 x --heartbeat; 30 s without one). Only a holder
that closes within that time of its admission, beside such a stranger, is noticed late.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from .curve import AUTHORIZED, CurveKeys

__all__ = ["Gate", "ZAP_ENDPOINT", "BUSY", "UNKNOWN_KEY"]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends ZAP requests (RFC 27): one handler per context."""

UNKNOWN_KEY = 400
BUSY = 500
_POLL_MS = 100
_LOGGED_MAX = 1000
"""Distinct refused keys and addresses logged; beyond that refusals are only counted (a flood of new keys
cannot grow memory or the log)."""


@dataclass
class _Slot:
    """One bound socket: its connections as the monitor reports them, and which ones may hold it."""

    what: str
    monitor: zmq.Socket | None = None
    undecided: set[int] = field(default_factory=set)  # accepted, not yet admitted (some refused, closing)
    holders: set[int] = field(default_factory=set)  # the admitted connection is one of these (see the module doc)
    generation: int = 0  # one more for every new holder
    held_once: bool = False
    vacated_at: float | None = None

    @property
    def held(self) -> bool:
        return bool(self.holders)

    def accepted(self, fd: int) -> None:
        self.undecided.add(fd)

    def closed(self, fd: int, now: float) -> None:
        self.undecided.discard(fd)
        if fd in self.holders:
            self.holders.discard(fd)
            if not self.holders:
                self.vacated_at = now

    def admit(self) -> bool:
        """A ZAP request to answer 200 (True) or busy (False): the asking connection is one of the undecided."""
        if self.holders:
            return False
        if not self.undecided:
            # libzmq (one I/O thread) queues a connection's accept before its request and `Gate._run` drains the
            # monitors first: none undecided means the asker has closed already. Nothing to hold.
            return True
        self.holders, self.undecided = self.undecided, set()
        self.held_once, self.vacated_at = True, None
        self.generation += 1
        return True


class Gate:
    """The ZAP handler and connection bookkeeping of one binding `ZmqTransport` (see the module doc).

    ``sockets`` maps a ZAP domain to (socket, what it is for the logs); call before the sockets bind.
    """

    def __init__(self, context: zmq.Context, sockets: dict[str, tuple[zmq.Socket, str]],
                 keys: CurveKeys | None = None) -> None:
        self.keys = keys
        self._authorized = {bytes(k) for k in keys.authorized} if keys is not None else set()
        self.refused: dict[int, int] = {UNKNOWN_KEY: 0, BUSY: 0}
        self._logged: set[tuple[int, str]] = set()
        self._lock = threading.Lock()
        self._zap = context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._slots: dict[bytes, _Slot] = {}
        for domain, (sock, what) in sockets.items():
            sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
            monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            self._slots[domain.encode()] = _Slot(what, monitor)
        self._sockets = [sock for sock, _ in sockets.values()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zap-gate", daemon=True)
        self._thread.start()

    # -- what the transport asks ------------------------------------------------
    def holder(self, domain: str) -> int | None:
        """Which admitted connection holds the socket (a number that changes with every new holder), or None."""
        with self._lock:
            slot = self._slots[domain.encode()]
            return slot.generation if slot.held else None

    def vacated_since(self, domain: str) -> float | None:
        """When the socket's admitted connection closed (with any that might have been it, see the module doc) and
        none replaced it (None: held, or never held)."""
        with self._lock:
            slot = self._slots[domain.encode()]
            return slot.vacated_at if slot.held_once and not slot.held else None

    def forget(self) -> None:
        """Every socket counts as never held until its next admitted connection (a new session waits)."""
        with self._lock:
            for slot in self._slots.values():
                if not slot.held:
                    slot.held_once, slot.vacated_at = False, None

    def stop(self) -> None:
        # Monitors off before the thread closes their reading ends: libzmq's I/O thread sends a monitor event
        # with a blocking send, and a PAIR socket whose peer has gone blocks, holding the lock that
        # `disable_monitor` then waits on (a hang at exit seen once in a few runs when the peer's
        # disconnect raced our close).
        for sock in self._sockets:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:  # pragma: no cover - closed already
                pass
        self._stop.set()
        self._thread.join(timeout=5)

    # -- the thread -------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        for slot in self._slots.values():
            poller.register(slot.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                self._drain_monitors()  # first: a ZAP request's connection was accepted before it was sent
                if self._zap in ready:
                    self._answer(self._zap.recv_multipart())
        except zmq.ContextTerminated:  # pragma: no cover - the transport closes us first
            pass
        finally:
            self._zap.close()
            for slot in self._slots.values():
                slot.monitor.close()

    def _drain_monitors(self) -> None:
        for slot in self._slots.values():
            while True:
                try:
                    event = recv_monitor_message(slot.monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                with self._lock:
                    if event["event"] == zmq.EVENT_ACCEPTED:
                        slot.accepted(event["value"])
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        slot.closed(event["value"], time.monotonic())

    def _answer(self, request: list[bytes]) -> None:
        if len(request) < 6:  # libzmq always sends 6+; answer anyway, a REP socket must
            self._reply(request[1] if len(request) > 1 else b"", 400, b"malformed ZAP request")
            return
        _version, request_id, domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        slot = self._slots.get(domain)
        peer = address.decode("ascii", "replace")
        if slot is None:
            self._reply(request_id, 400, b"unknown ZAP domain")
            return
        if self.keys is not None:
            key = z85.encode(credentials[0]) if mechanism == b"CURVE" and len(credentials) == 1 else b""
            if key not in self._authorized:
                self._refuse(request_id, UNKNOWN_KEY, key.decode("ascii", "replace") or mechanism.decode(
                    "ascii", "replace"), f"refused a peer whose CURVE key {key.decode('ascii', 'replace')} is not in "
                    f"{self.keys.source}/{AUTHORIZED} (from {peer}; the session goes on)")
                return
        with self._lock:
            busy = not slot.admit()
        if busy:
            self._refuse(request_id, BUSY, peer, f"refused a connection from {peer} to {slot.what}: it is "
                         "taken by the session's peer (one at a time; the session goes on)")
            return
        self._reply(request_id, 200, b"OK")

    def _refuse(self, request_id: bytes, code: int, who: str, line: str) -> None:
        with self._lock:
            self.refused[code] += 1
            first = (code, who) not in self._logged and len(self._logged) < _LOGGED_MAX
            if first:
                self._logged.add((code, who))
        if first:
            log.warning("%s", line)
        self._reply(request_id, code, b"not authorised" if code == UNKNOWN_KEY else b"taken")

    def _reply(self, request_id: bytes, code: int, text: bytes) -> None:
        self._zap.send_multipart([b"1.0", request_id, str(code).encode(), text, b"", b""])
