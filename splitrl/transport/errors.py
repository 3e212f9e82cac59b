"""Errors raised by transports. Everything wrong on the wire is one `ProtocolError`."""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["ProtocolError", "TransportTimeout", "TransportClosed", "PeerAbort", "PeerGone", "peer_text", "peer_repr"]

PEER_TEXT_CHARS = 200
"""How much of a string a peer sent we print."""

_REPR = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 6, 6, 60, 60, 40


def peer_text(value: Any, limit: int = PEER_TEXT_CHARS) -> str:
    """A string from the peer as it may be logged: control characters (newlines included) escaped, so a
    peer cannot forge log lines, and cut to ``limit`` characters."""
    text = value if isinstance(value, str) else peer_repr(value)
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."


def peer_repr(value: Any, limit: int = 80) -> str:
    """``repr`` of a value from the peer, bounded in depth and length (never a RecursionError)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ProtocolError(Exception):
    """A frame or message broke the wire protocol.

    The message says what was expected and what arrived. The offending message
    has been dropped; the transport itself stays usable.
    """


class TransportTimeout(TimeoutError):
    """No message (or no room to send one) within the allowed time."""


class PeerGone(ConnectionError):
    """The peer closed or reset the connection (TCP), or its connection closed or its heartbeats stopped and
    it did not come back in time (ZeroMQ)."""


class TransportClosed(RuntimeError):
    """The transport was used after `close()`."""


class PeerAbort(RuntimeError):
    """The peer told us it is stopping (an ``abort`` message) and why."""
