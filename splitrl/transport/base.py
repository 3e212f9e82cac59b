"""The Transport interface: send and receive messages, count every byte.

A transport knows nothing about RL. Subclasses move lists of frames; this class
does the framing, the sequence numbers and the byte meters, so every transport
counts the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .errors import PeerAbort, PeerGone, ProtocolError, TransportClosed, TransportTimeout, peer_repr, peer_text
from .fastwire import FastWire
from .wire import _MAX_SEQ, ABORT_KIND, HELLO_KIND, Message, WireLimits, frame_nbytes, session_of

__all__ = ["Transport", "Watch", "ByteMeter", "MeterEntry", "INVALID_KIND", "STRANGER_KIND", "WAITING_LINE_EVERY"]

log = logging.getLogger(__name__)

_RESUME_SEQ = (_MAX_SEQ + 1) // 2
"""The largest position a resumed session numbers on from: it leaves as many numbers again to count."""

INVALID_KIND = "_invalid"
"""Meter key for received frames that did not decode (not a legal kind, so it cannot collide)."""

WAITING_LINE_EVERY = 5.0
"""Seconds between the lines a transport logs while a receive waits, saying what for."""

STRANGER_KIND = "_stranger"
"""Meter key for received messages dropped because they are not the session's (`Transport.session`)."""


@dataclass
class MeterEntry:
    bytes: int = 0
    messages: int = 0
    frames: int = 0


class ByteMeter:
    """Bytes, messages and frames per (message kind, direction), as they crossed the link.

    Bytes are frame payloads: the header frame and every tensor frame. Transport
    framing below that (ZMTP's 2-9 bytes per frame, TCP/IP headers) is not counted.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], MeterEntry] = defaultdict(MeterEntry)
        self._lock = threading.Lock()  # a link shared by two threads (`splitrl.transport.channels`)

    def add(self, kind: str, direction: str, nbytes: int, nframes: int) -> None:
        with self._lock:
            entry = self._entries[(kind, direction)]
            entry.bytes += nbytes
            entry.messages += 1
            entry.frames += nframes

    def restore(self, snapshot: dict[str, int]) -> dict[str, int]:
        """Count on from an earlier `snapshot` (a checkpoint's: a resumed run's counters go on from the run's, as
        if it had not stopped). What was counted before is left out of them and returned: a resumed session's
        opening (its handshake), which the uninterrupted run did not send again."""
        before = self.snapshot()
        with self._lock:
            self._entries.clear()
            for key, value in snapshot.items():
                _, kind, rest = key.split("/", 2)
                direction, _, what = rest.partition("_")
                entry = self._entries[(kind, direction)]
                if what == "bytes":
                    entry.bytes += value
                elif what == "messages":
                    entry.messages += value
        return before

    def entry(self, kind: str, direction: str) -> MeterEntry:
        return self._entries.get((kind, direction), MeterEntry())

    def total(self, direction: str | None = None) -> int:
        with self._lock:
            return sum(e.bytes for (_, d), e in self._entries.items() if direction in (None, d))

    def snapshot(self) -> dict[str, int]:
        """Flat counters as ``net/<kind>/<direction>_bytes`` and ``..._messages``."""
        out: dict[str, int] = {}
        with self._lock:
            entries = sorted((key, MeterEntry(e.bytes, e.messages, e.frames)) for key, e in self._entries.items())
        for (kind, direction), e in entries:
            out[f"net/{kind}/{direction}_bytes"] = e.bytes
            out[f"net/{kind}/{direction}_messages"] = e.messages
        return out


class Transport(ABC):
    """One end of a bidirectional message link to a single peer.

    ``send`` hands tensors to the link without copying where it can: a sent
    tensor must not be modified afterwards (stages only ever send fresh tensors).
    ``recv`` raises `TransportTimeout` naming the peer when nothing arrives in
    time, `ProtocolError` for a malformed message or a gap in the sequence
    numbers (the transport stays usable), and `PeerAbort` when the peer says it
    is stopping.

    Once the handshake sets `session` (an id both sides learn from stage1's hello),
    every message sent carries it, and a received message that does not carry it is
    a stranger's: dropped, counted (`strangers`, and the meter's ``_stranger`` kind),
    logged now and then, never fatal; the receive goes on waiting for the peer.
    """

    def __init__(self, *, peer: str, timeout: float, limits: WireLimits) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.peer = peer
        self.timeout = float(timeout)
        self.limits = limits
        self.wire = FastWire(limits)  # this link's encoder and decoder, and what they remember
        self.meter = ByteMeter()
        self._send_seq = 0
        self._recv_seq = 0
        self._closed = False
        self.session: int | None = None
        self.strangers = 0
        self._reopened: Message | None = None  # a restarted peer's hello, kept for the next session

    # -- what subclasses provide ------------------------------------------------
    @abstractmethod
    def _send_frames(self, frames: list[Any], timeout: float) -> None:
        """Send one multi-frame message atomically or raise `TransportTimeout`."""

    @abstractmethod
    def _recv_frames(self, timeout: float) -> Sequence[Any]:
        """Return the frames of one message or raise `TransportTimeout`."""

    @abstractmethod
    def _close(self) -> None:
        """Release sockets; bounded in time."""

    # -- the interface ----------------------------------------------------------
    def send(
        self,
        kind: str,
        tensors: Mapping[str, torch.Tensor] | None = None,
        header: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> int:
        """Send one message; returns the bytes it cost on the link."""
        self._check_open()
        frames = self.wire.encode(kind, self._send_seq, header, tensors, sid=self.session)
        self._send_frames(frames, self.timeout if timeout is None else timeout)
        self._send_seq += 1
        nbytes = sum(frame_nbytes(f) for f in frames)
        self.meter.add(kind, "sent", nbytes, len(frames))
        return nbytes

    def recv(self, timeout: float | None = None) -> Message:
        """Receive the next message within ``timeout`` seconds (default: the transport's)."""
        self._check_open()
        budget = whole = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        while True:
            try:
                frames = self._recv_frames(budget)
            except TransportTimeout:
                if budget == whole:
                    raise
                raise TransportTimeout(f"no message from {self.peer} within {whole:g} s (only strangers': "
                                       f"{self.strangers} dropped so far)") from None
            msg = self._decoded(frames)
            if msg is not None:
                break
            budget = max(0.001, deadline - time.monotonic())
        if msg.kind == ABORT_KIND:  # the peer's last word, whatever its number (it may not have numbered on yet)
            raise PeerAbort(f"{self.peer} stopped: {peer_text(msg.header.get('reason', 'no reason given'), 2000)}")
        expected = self._recv_seq
        if msg.seq >= expected:  # after a gap, resynchronise; a replay must not rewind
            self._recv_seq = msg.seq + 1
        if msg.seq != expected:
            what = f"{msg.seq - expected} message(s) lost" if msg.seq > expected else "a duplicate or replay"
            raise ProtocolError(
                f"from {self.peer}: sequence number: expected {expected}, got {msg.seq} ({what}); message dropped"
            )
        return msg

    def recv_opening(self, kind: str, timeout: float | None = None) -> Message:
        """The first message of a session, of ``kind``: anything else that arrives first (frames that do not
        decode, other kinds, a connection that closes) is a stranger's, dropped and counted like one, and the
        wait goes on. A restarted peer's hello that ended the last session (`PeerGone`) comes first."""
        if self._reopened is not None and self._reopened.kind == kind:
            msg, self._reopened = self._reopened, None
            self._recv_seq = msg.seq + 1
            return msg
        budget = whole = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        while True:
            try:
                msg = self.recv(budget)
            except (ProtocolError, PeerAbort, PeerGone) as exc:
                what = str(exc)
            else:
                if msg.kind == kind:
                    return msg
                what = f"a {peer_text(msg.kind, 40)!r} message before any {kind!r}"
            self._recv_seq = 0  # a stranger's message does not move the session's sequence
            self._stranger(0, 0, what)
            self._drop_stranger()
            budget = deadline - time.monotonic()
            if budget <= 0:
                raise TransportTimeout(f"no {kind!r} from {self.peer} within {whole:g} s (only strangers': "
                                       f"{self.strangers} dropped)")

    def _decoded(self, frames: Sequence[Any]) -> Message | None:
        """The message, None for a stranger's (dropped and counted), or `ProtocolError` for a malformed one
        of the session's (or of anyone's before there is a session)."""
        try:
            msg = self.wire.decode(frames, learn_for=self.session)  # learns the session's layouts
        except ProtocolError as exc:
            nbytes = sum(frame_nbytes(f) for f in frames)
            if self.session is not None and session_of(frames, self.limits) != self.session:
                self._stranger(nbytes, len(frames), str(exc))
                return None
            self.meter.add(INVALID_KIND, "recv", nbytes, len(frames))
            raise ProtocolError(f"from {self.peer}: {exc}") from None
        if self.session is not None and msg.sid != self.session:
            if msg.kind == HELLO_KIND and msg.sid is None and msg.seq == 0:
                # Only the peer holding our one connection can send it (strangers are refused, section 8 of
                # docs/PROTOCOL.md), and the session's peer never says hello twice: a new process took its place.
                self.meter.add(msg.kind, "recv", msg.nbytes, len(frames))
                self._reopened = msg
                raise PeerGone(f"{self.peer} started over: a new process opened a new session (its hello came "
                               "in the middle of this one)")
            self._stranger(msg.nbytes, len(frames), f"a {peer_text(msg.kind, 40)!r} message of session {msg.sid}")
            return None
        self.meter.add(msg.kind, "recv", msg.nbytes, len(frames))
        return msg

    def _stranger(self, nbytes: int, nframes: int, what: str) -> None:
        self.strangers += 1
        self.meter.add(STRANGER_KIND, "recv", nbytes, nframes)
        count = self.strangers
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: a flood cannot flood the log
            log.warning("dropped a message that is not this session's (%d so far): %s", count, peer_text(what, 200))

    def _drop_stranger(self) -> None:
        """Before a session: let go of the connection a stranger's message came on, where a transport can
        (plain TCP); ZeroMQ's gate and handshake timeout bound its connections instead."""

    def pending(self) -> bool:
        """Whether a message (or a stranger's frames) waits to be received: a receive would not block."""
        raise NotImplementedError(f"{type(self).__name__} cannot tell whether a message waits")

    def check_alive(self) -> None:
        """`PeerGone` if the liveness layer (``--heartbeat``) counts the peer gone; a receive checks this too."""

    @staticmethod
    def watch(links: Sequence["Transport"]) -> "Watch":
        """A `Watch` over ``links`` (of this transport's kind): waits for whichever has a message."""
        return Watch(links)

    def sequence(self, ahead: int = 0) -> dict[str, int]:
        """Where this session's sequence numbers stand: the next to send (``ahead`` messages further on, for a side
        that is about to send them) and the next expected. A checkpoint keeps it for `go_on_from`."""
        return {"sent": self._send_seq + ahead, "received": self._recv_seq}

    def go_on_from(self, position: Mapping[str, Any]) -> None:
        """Number on from a checkpoint's `sequence`, after a resumed session's opening (docs/PROTOCOL.md section 6):
        its messages then cost on the link what the uninterrupted run's did (a larger number can take more
        bytes). Both sides do it from their checkpoints of the same iteration; `ValueError` for a bad position."""
        sent, received = (position.get("sent"), position.get("received")) if isinstance(position, Mapping) else (0, 0)
        if not all(type(n) is int and 1 <= n <= _RESUME_SEQ for n in (sent, received)):
            raise ValueError(f"a link's sequence position must be two ints in [1, 2**62], got {peer_repr(position)}")
        self._send_seq, self._recv_seq = sent, received

    def new_session(self) -> None:
        """Forget the session and its sequence numbers: the next ``hello`` opens another (a peer that
        rejoins after its predecessor was lost). What the old session sent and left queued is a stranger's."""
        self.session = None
        self._send_seq = self._recv_seq = 0

    def abort(self, reason: str, timeout: float = 1.0) -> None:
        """Tell the peer we are stopping. Best effort: never raises."""
        if self._closed:
            return
        try:
            self.send(ABORT_KIND, header={"reason": str(reason)[:2000]}, timeout=timeout)
        except Exception as exc:  # the peer may be gone already; nothing to do about it
            log.debug("could not send abort to %s: %s", self.peer, exc)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"transport to {self.peer} is closed")

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Watch:
    """Waits on several links at once for whichever has a message (`Transport.watch`). This one looks at each
    link every half millisecond; `ZmqTransport`'s waits in one poll."""

    def __init__(self, links: Sequence[Transport]) -> None:
        self.links = list(links)

    def wait(self, timeout: float) -> list[int]:
        """The indices of the links with a message waiting: at once those that have one, else within
        ``timeout`` seconds those that have one when the first does (or none)."""
        deadline = time.monotonic() + timeout
        while True:
            ready = [i for i, link in enumerate(self.links) if link.pending()]
            if ready or time.monotonic() >= deadline:
                return ready
            time.sleep(0.0005)
