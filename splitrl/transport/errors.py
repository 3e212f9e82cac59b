"""Errors raised by transports. Everything wrong on the wire is one `ProtocolError`."""

from __future__ import annotations

__all__ = ["ProtocolError", "TransportTimeout", "TransportClosed", "PeerAbort"]


class ProtocolError(Exception):
    """A frame or message broke the wire protocol.

    The message says what was expected and what arrived. The offending message
    has been dropped; the transport itself stays usable.
    """


class TransportTimeout(TimeoutError):
    """No message (or no room to send one) within the allowed time."""


class TransportClosed(RuntimeError):
    """The transport was used after `close()`."""


class PeerAbort(RuntimeError):
    """The peer told us it is stopping (an ``abort`` message) and why."""
