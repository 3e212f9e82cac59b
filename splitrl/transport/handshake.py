"""The first exchange on every link: who is talking, and do both sides agree?

Both sides send ``hello`` and check the peer's, so a mismatch stops both with the
same list of differing settings.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from .base import Transport
from .errors import ProtocolError
from .wire import HELLO_KIND, PROTOCOL_VERSION, Message

__all__ = ["HandshakeError", "handshake", "send_hello", "check_hello", "settings_hash"]


class HandshakeError(ProtocolError):
    """The peer is the wrong role, speaks another protocol version or has other settings."""


def settings_hash(settings: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the settings as canonical JSON: sorted keys, no spaces."""
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _differences(mine: Mapping[str, Any], theirs: Any, role: str, peer_role: str) -> list[str]:
    if not isinstance(theirs, dict):
        return [f"settings: the {peer_role} sent no settings map"]
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key, "<unset>"), theirs.get(key, "<unset>")
        if a != b:
            out.append(f"{key}: {role}={a!r} {peer_role}={b!r}")
    return out


def send_hello(transport: Transport, role: str, settings: Mapping[str, Any], timeout: float | None = None,
               extra: Mapping[str, Any] | None = None) -> None:
    """Send our ``hello``. ``settings`` must be JSON- and msgpack-serialisable; ``extra``: more fields the
    application wants the peer to know (e.g. the checkpoints it could resume from)."""
    header = {"proto": PROTOCOL_VERSION, "role": role, "settings_hash": settings_hash(settings),
              "settings": dict(settings), **(extra or {})}
    transport.send(HELLO_KIND, header=header, timeout=timeout)


def check_hello(msg: Message, role: str, peer_role: str, settings: Mapping[str, Any], peer: str) -> dict[str, Any]:
    """Return the peer's hello header, or raise `HandshakeError` saying what differs."""
    if msg.kind != HELLO_KIND:
        raise HandshakeError(f"handshake with {peer}: expected a 'hello' message, got {msg.kind!r}")
    hello = msg.header
    if hello.get("proto") != PROTOCOL_VERSION:
        raise HandshakeError(f"handshake with {peer}: protocol version: expected {PROTOCOL_VERSION}, got {hello.get('proto')!r}")
    if hello.get("role") != peer_role:
        raise HandshakeError(
            f"handshake with {peer}: expected a {peer_role}, got {hello.get('role')!r}"
            + (" (both sides think they are the same stage)" if hello.get("role") == role else "")
        )
    if hello.get("settings_hash") != settings_hash(settings):
        diffs = _differences(settings, hello.get("settings"), role, peer_role) or ["(hashes differ, values look equal)"]
        raise HandshakeError("settings differ between the stages: " + "; ".join(diffs))
    return hello


def handshake(
    transport: Transport, role: str, peer_role: str, settings: Mapping[str, Any], timeout: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Send our ``hello``, receive the peer's; return its header or raise `HandshakeError`.

    This is the initiator's side. The responder (stage1) answers with `send_hello`
    before it runs `check_hello`, so a mismatch is seen, and reported, by both sides.
    """
    send_hello(transport, role, settings, timeout, extra)
    return check_hello(transport.recv(timeout=timeout), role, peer_role, settings, transport.peer)
