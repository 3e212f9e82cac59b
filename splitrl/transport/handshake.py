"""The first exchange on every link: who is talking, do both sides agree, and which session is this?

The initiator (stage0) sends ``hello`` with its settings; the responder (stage1) answers
with the settings' hash only, the names of the settings that differ (their values stay in
its own log: an unauthenticated peer learns nothing it did not send), and a fresh session
id in the outer header, which every later message of both sides carries
(`Transport.session`). A mismatch stops both, each naming the differing settings.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any, Mapping

from .base import Transport
from .errors import ProtocolError, peer_repr, peer_text
from .wire import HELLO_KIND, MAX_SESSION_ID, PROTOCOL_VERSION, Message

__all__ = ["HandshakeError", "handshake", "send_hello", "check_hello", "settings_hash", "differing", "new_session", "answer_hello"]


class HandshakeError(ProtocolError):
    """The peer is the wrong role, speaks another protocol version or has other settings."""


def settings_hash(settings: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the settings as canonical JSON: sorted keys, no spaces."""
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


_FIRST_SESSION_ID = 1 << 16
"""The smallest id `new_session` draws: every id it draws is a msgpack uint32 (5 bytes), so which one a session
gets never changes what its messages cost on the link (a resumed run's counters equal the uninterrupted run's)."""


def new_session() -> int:
    """A random session id for the outer header's ``i`` (`splitrl.transport.wire`), in [2**16, 2**32)."""
    return _FIRST_SESSION_ID + secrets.randbelow(MAX_SESSION_ID + 1 - _FIRST_SESSION_ID)


def differing(mine: Mapping[str, Any], theirs: Any) -> list[str]:
    """The names of the settings that differ (all of ours when the peer sent no settings map)."""
    if not isinstance(theirs, dict):
        return sorted(mine)
    return [peer_text(k, 60) for k in sorted(set(mine) | set(theirs), key=str) if mine.get(k, "<unset>") != theirs.get(k, "<unset>")]


def _differences(mine: Mapping[str, Any], theirs: Any, role: str, peer_role: str) -> list[str]:
    if not isinstance(theirs, dict):
        return [f"settings: the {peer_role} sent no settings map"]
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key, "<unset>"), theirs.get(key, "<unset>")
        if a != b:
            out.append(f"{peer_text(key, 60)}: {role}={a!r} {peer_role}={peer_text(peer_repr(b))}")
    return out


def send_hello(transport: Transport, role: str, settings: Mapping[str, Any], timeout: float | None = None,
               extra: Mapping[str, Any] | None = None, *, reveal: bool = True) -> None:
    """Send our ``hello``. ``settings`` must be JSON- and msgpack-serialisable; ``reveal=False`` sends their
    hash only; ``extra``: more fields the application wants the peer to know (e.g. the checkpoints it could
    resume from, the names of the settings that differ)."""
    header = {"proto": PROTOCOL_VERSION, "role": role, "settings_hash": settings_hash(settings),
              **({"settings": dict(settings)} if reveal else {}), **(extra or {})}
    transport.send(HELLO_KIND, header=header, timeout=timeout)


def check_hello(msg: Message, role: str, peer_role: str, settings: Mapping[str, Any], peer: str) -> dict[str, Any]:
    """Return the peer's hello header, or raise `HandshakeError` saying what differs."""
    if msg.kind != HELLO_KIND:
        raise HandshakeError(f"handshake with {peer}: expected a 'hello' message, got {msg.kind!r}")
    hello = msg.header
    if hello.get("proto") != PROTOCOL_VERSION:
        raise HandshakeError(f"handshake with {peer}: protocol version: expected {PROTOCOL_VERSION}, "
                             f"got {peer_text(peer_repr(hello.get('proto')))}")
    if hello.get("role") != peer_role:
        raise HandshakeError(
            f"handshake with {peer}: expected a {peer_role}, got {peer_text(peer_repr(hello.get('role')))}"
            + (" (both sides think they are the same stage)" if hello.get("role") == role else "")
        )
    if hello.get("settings_hash") != settings_hash(settings):
        if "settings" in hello:
            diffs = _differences(settings, hello["settings"], role, peer_role) or ["(hashes differ, values look equal)"]
        else:  # the peer revealed its hash only: name what differs, with our values
            names = hello.get("differ")
            names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
            diffs = [f"{peer_text(n, 60)}: {role}={settings.get(n, '<unset>')!r}" for n in names[:100]]
            diffs.append(f"({peer_role}'s values are in its log)" if diffs else
                         f"(the settings' hashes differ; {peer_role}'s log lists what)")
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
    msg = transport.recv(timeout=timeout)
    transport.session = msg.sid  # first: an abort of ours must reach the peer as its session's
    hello = check_hello(msg, role, peer_role, settings, transport.peer)
    if msg.sid is None:
        raise HandshakeError(f"handshake with {transport.peer}: its hello carries no session id (an older splitrl?)")
    return hello


def answer_hello(transport: Transport, role: str, peer_role: str, settings: Mapping[str, Any],
                 timeout: float | None = None, extra: Mapping[str, Any] | None = None,
                 reply_timeout: float | None = None) -> dict[str, Any]:
    """The responder's side: wait for the initiator's ``hello`` (a stranger's frames before it are dropped),
    open a session, answer with our hash, the names of the settings that differ and the session id, then
    check; returns the initiator's hello header or raises `HandshakeError`. The answer may take
    ``reply_timeout`` to leave (default ``timeout``): a peer's receiving connection can come up after its
    hello arrived, so a short wait for the hello needs a longer one for the answer."""
    msg = transport.recv_opening(HELLO_KIND, timeout=timeout)
    theirs = msg.header.get("settings")
    differ = differing(settings, theirs) if msg.header.get("settings_hash") != settings_hash(settings) else []
    transport.session = new_session()
    send_hello(transport, role, settings, timeout if reply_timeout is None else reply_timeout,
               {**(extra or {}), **({"differ": differ} if differ else {})}, reveal=False)
    return check_hello(msg, role, peer_role, settings, transport.peer)
