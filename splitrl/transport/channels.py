"""Several message streams over one link, each used by a thread of its own.

A `Transport` has one sequence of messages in each direction and is used by one
thread. When a process runs two loops at once (the asynchronous schedule: one
thread acting in the environments, one training), `Channels` shares one link
between them: sends go out under a lock, in one sequence; a receiver thread reads
every message and hands it to the channel its kind belongs to. Each `Channel`
looks like a transport to the loop that owns it (``send``, ``recv`` with a
timeout, ``meter``, ``peer``, ``abort``), so the same loop code runs over either.

Anything that stops the link (the peer's ``abort``, a malformed message, a kind
no channel takes) is raised in every channel's next ``recv``, so no loop waits
forever on a link that is gone.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Mapping

import torch

from .base import ByteMeter, Transport
from .errors import ProtocolError, TransportTimeout
from .wire import Message

__all__ = ["Channels", "Channel"]

_POLL_S = 0.2
"""How often the receiver thread looks up from the link to see whether it should stop."""


class Channel:
    """One stream of a `Channels`: the messages of its kinds, in the order they arrived."""

    def __init__(self, owner: "Channels", name: str) -> None:
        self.owner, self.name = owner, name
        self.inbox: queue.SimpleQueue[Message | BaseException] = queue.SimpleQueue()
        self.timeout = owner.link.timeout

    @property
    def peer(self) -> str:
        return self.owner.link.peer

    @property
    def meter(self) -> ByteMeter:
        return self.owner.link.meter

    def send(self, kind: str, tensors: Mapping[str, torch.Tensor] | None = None,
             header: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> int:
        with self.owner.send_lock:
            return self.owner.link.send(kind, tensors, header, timeout=timeout)

    def recv(self, timeout: float | None = None) -> Message:
        wait = self.timeout if timeout is None else timeout
        try:
            item = self.inbox.get(timeout=wait)
        except queue.Empty:
            raise TransportTimeout(f"no message from {self.peer} within {wait:g} s ({self.name})") from None
        if isinstance(item, BaseException):
            self.inbox.put(item)  # every later recv fails the same way
            raise item
        return item

    def abort(self, reason: str, timeout: float = 1.0) -> None:
        with self.owner.send_lock:
            self.owner.link.abort(reason, timeout)


class Channels:
    """The channels of one link; ``routes`` maps each message kind to the channel that takes it."""

    def __init__(self, link: Transport, routes: Mapping[str, str]) -> None:
        self.link = link
        self.routes = dict(routes)
        self.send_lock = threading.Lock()
        self.channels = {name: Channel(self, name) for name in sorted(set(self.routes.values()))}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name=f"{link.peer} receiver", daemon=True)
        self._thread.start()

    def __getitem__(self, name: str) -> Channel:
        return self.channels[name]

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.link.recv(timeout=_POLL_S)
            except TransportTimeout:
                continue  # each channel's own recv times out; this thread only keeps reading
            except BaseException as exc:
                self.fail(exc)
                return
            name = self.routes.get(msg.kind)
            if name is None:
                self.fail(ProtocolError(f"from {self.link.peer}: no channel takes {msg.kind!r} "
                                         f"(expected one of {', '.join(sorted(self.routes))})"))
                return
            self.channels[name].inbox.put(msg)

    def fail(self, exc: BaseException) -> None:
        """Make every channel's next ``recv`` raise ``exc`` (the link, or a thread using it, has failed)."""
        for channel in self.channels.values():
            channel.inbox.put(exc)

    def close(self) -> None:
        """Stop the receiver thread (the link itself stays open: its owner closes it)."""
        self._stop.set()
        self._thread.join(timeout=5 * _POLL_S + 1)
