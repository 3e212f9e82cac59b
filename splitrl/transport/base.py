"""The Transport interface: send and receive messages, count every byte.

A transport knows nothing about RL. Subclasses move lists of frames; this class
does the framing, the sequence numbers and the byte meters, so every transport
counts the same way.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .errors import PeerAbort, ProtocolError, TransportClosed
from .wire import ABORT_KIND, Message, WireLimits, decode, encode, frame_nbytes

__all__ = ["Transport", "ByteMeter", "MeterEntry", "INVALID_KIND"]

log = logging.getLogger(__name__)

INVALID_KIND = "_invalid"
"""Meter key for received frames that did not decode (not a legal kind, so it cannot collide)."""


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

    def restore(self, snapshot: dict[str, int]) -> None:
        """Add the counts of an earlier `snapshot` (a resumed run goes on counting from there)."""
        with self._lock:
            for key, value in snapshot.items():
                _, kind, rest = key.split("/", 2)
                direction, _, what = rest.partition("_")
                entry = self._entries[(kind, direction)]
                if what == "bytes":
                    entry.bytes += value
                elif what == "messages":
                    entry.messages += value

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
    """

    def __init__(self, *, peer: str, timeout: float, limits: WireLimits) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.peer = peer
        self.timeout = float(timeout)
        self.limits = limits
        self.meter = ByteMeter()
        self._send_seq = 0
        self._recv_seq = 0
        self._closed = False

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
        frames = encode(kind, self._send_seq, header, tensors)
        self._send_frames(frames, self.timeout if timeout is None else timeout)
        self._send_seq += 1
        nbytes = sum(frame_nbytes(f) for f in frames)
        self.meter.add(kind, "sent", nbytes, len(frames))
        return nbytes

    def recv(self, timeout: float | None = None) -> Message:
        """Receive the next message within ``timeout`` seconds (default: the transport's)."""
        self._check_open()
        frames = self._recv_frames(self.timeout if timeout is None else timeout)
        try:
            msg = decode(frames, self.limits)
        except ProtocolError as exc:
            self.meter.add(INVALID_KIND, "recv", sum(frame_nbytes(f) for f in frames), len(frames))
            raise ProtocolError(f"from {self.peer}: {exc}") from None
        self.meter.add(msg.kind, "recv", msg.nbytes, len(frames))
        expected = self._recv_seq
        if msg.seq >= expected:  # after a gap, resynchronise; a replay must not rewind
            self._recv_seq = msg.seq + 1
        if msg.seq != expected:
            what = f"{msg.seq - expected} message(s) lost" if msg.seq > expected else "a duplicate or replay"
            raise ProtocolError(
                f"from {self.peer}: sequence number: expected {expected}, got {msg.seq} ({what}); message dropped"
            )
        if msg.kind == ABORT_KIND:
            raise PeerAbort(f"{self.peer} stopped: {msg.header.get('reason', 'no reason given')}")
        return msg

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
