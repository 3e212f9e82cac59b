"""Whether a `ZmqTransport`'s peer is there: socket monitor events, a binder's `Gate`, and the grace of a gone peer.

The connecting side learns of its one connection from socket monitors: its peer is there
once a ZMTP handshake has succeeded (a stopped process still completes TCP connects, and
a key CURVE refuses completes none) and gone only after one has; a refusal by the
binder's `Gate` is final. A binding side asks its `Gate` who holds the receiving
socket's place. Either way, a connection gone for longer than its grace (2/5 of
``--heartbeat``) is a `PeerGone`. Nothing here blocks: the transport's waits call
`Liveness.drain` and `Liveness.check` between their slices.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .errors import PeerGone
from .gate import BUSY, UNKNOWN_KEY, Gate
from .zmq_sockets import HEARTBEAT_TIMEOUT_SHARE

__all__ = ["Liveness"]

_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
"""What the connecting side's monitor reports (the binding side's `Gate` watches its own)."""

_GATE_CHECK_EVERY = 0.2
"""Seconds between a binding side's looks at its `Gate` while it waits to send."""


def _drained(monitor: zmq.Socket | None) -> list[dict[str, Any]]:
    """The events a socket monitor holds now (none for no monitor)."""
    events = []
    while monitor is not None:
        try:
            events.append(recv_monitor_message(monitor, zmq.NOBLOCK))
        except zmq.Again:
            break
    return events


class Liveness:
    """What one `ZmqTransport` knows of its peer's connections (see the module docstring).

    A connecting side with a heartbeat gets two monitors: ``monitor`` on the receiving socket (its peer's
    liveness) and ``push_monitor`` on the sending one (admitted or refused: a binder admits each socket's
    connection apart). A binder with a heartbeat watches ``gate`` once a session exists.
    """

    def __init__(self, pull: zmq.Socket, push: zmq.Socket, *, heartbeat: float, bind: bool,
                 gate: Gate | None) -> None:
        self.heartbeat = heartbeat
        self.grace = heartbeat * HEARTBEAT_TIMEOUT_SHARE
        self.gate = gate
        self._socks = (pull, push)
        self.monitor = pull.get_monitor_socket(_LINK_EVENTS) if heartbeat > 0 and not bind else None
        self.push_monitor = push.get_monitor_socket(_LINK_EVENTS) if heartbeat > 0 and not bind else None
        self.push_joined = False
        self.joined = False
        self.watched = self.monitor is not None or self.push_monitor is not None or (gate is not None and heartbeat > 0)
        """Whether a wait has liveness to look at between its slices: monitors, or a binder's Gate."""
        self.early_drops = 0
        """Connections closed before any handshake succeeded."""
        self.refused: int | None = None
        """The binder's ZAP status code once it refused us."""
        self.gone_since: float | None = None
        self.holder: int | None = None
        """The connection of the session's peer (a binder's `Gate` generation)."""

    def drain(self) -> None:
        """Take in the monitors' events."""
        for event in _drained(self.monitor):
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.joined = True
                self.gone_since = None
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = event["value"]
            elif kind == zmq.EVENT_DISCONNECTED:
                if not self.joined:
                    self.early_drops += 1
                elif self.gone_since is None:
                    self.gone_since = time.monotonic()
        for event in _drained(self.push_monitor):  # the sending socket: admitted or refused (liveness is the pull's)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.push_joined = True
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = event["value"]

    def check(self, peer: str, session: int | None) -> None:
        """`PeerGone` when the binder refused us, or when the peer's connection has been gone for the grace.
        A binder watches its `Gate` only once a ``session`` exists (before it, a connection that comes and goes
        is a stranger's) and counts a new holder of its socket as the old peer gone."""
        if self.refused is not None:
            raise PeerGone(self.refusal(peer))
        if self.gate is not None and self.heartbeat > 0:
            if session is None:
                self.gone_since = None
            else:
                if self.holder is None:
                    self.holder = self.gate.holder("recv")
                elif self.gate.holder("recv") not in (None, self.holder):
                    raise PeerGone(f"{peer} is gone: another connection holds its place now (a restarted peer; or "
                                   f"ZeroMQ dropped a connection whose message took longer than "
                                   f"{HEARTBEAT_TIMEOUT_SHARE * self.heartbeat:g} s to arrive, 2/5 of --heartbeat: on a thin link "
                                   "give both stages a --heartbeat of 2.5 x the largest message's transfer time)")
                self.gone_since = self.gate.vacated_since("recv")
        if self.gone_since is not None and time.monotonic() >= self.gone_since + self.grace:
            raise PeerGone(f"{peer} is gone: its connection closed (or went silent) and it did not come "
                           f"back within {self.grace:g} s (--heartbeat {self.heartbeat:g})")

    def refusal(self, peer: str) -> str:
        why = {UNKNOWN_KEY: "it does not authorise this side's CURVE key (its key directory's authorized/ must "
                            "hold our public key)",
               BUSY: "it is serving another peer (one session at a time; if that was us before a restart, it "
                     "notices within its --heartbeat; start both with --resume then)"}
        return f"{peer} refused this connection: {why.get(self.refused, f'ZAP status {self.refused}')}"

    def timeout_hint(self) -> str:
        """What a receive that timed out should add: connections that closed before a handshake, if any."""
        if not self.joined and self.early_drops:
            return (f" ({self.early_drops} connection(s) closed before a handshake completed: a peer that "
                    "is not the one expected, or with --curve a server key that is not the one pinned)")
        return ""

    def poll_ms(self, until: float) -> int:
        """How long one poll may block: to ``until``, but no longer than liveness needs to look again."""
        now = time.monotonic()
        wake = until
        if self.gate is not None and self.heartbeat > 0:
            wake = min(wake, now + _GATE_CHECK_EVERY)
        gone_since = self.gone_since  # once: another thread's liveness check may clear it meanwhile
        if gone_since is not None:
            wake = min(wake, gone_since + self.grace)
        return max(0, int((wake - now) * 1000)) + 1

    def register(self, poller: zmq.Poller) -> None:
        """Put the monitors on ``poller``, so a wait wakes for their events."""
        for monitor in (self.monitor, self.push_monitor):
            if monitor is not None:
                poller.register(monitor, zmq.POLLIN)

    def forget(self) -> None:
        """A new session: the lost peer's vacancy is no longer news; wait for the next one."""
        self.gone_since = self.holder = None
        if self.gate is not None:
            self.gate.forget()

    def close(self) -> None:
        """Both monitors off before either reading end closes (see `Gate.stop`: libzmq's blocking monitor sends)."""
        for sock, monitor in zip(self._socks, (self.monitor, self.push_monitor)):
            if monitor is not None:
                sock.disable_monitor()
        for monitor in (self.monitor, self.push_monitor):
            if monitor is not None:
                monitor.close()
