"""An in-process link for the single-process twin: same framing, same meters, no socket.

Frames are copied into the peer's inbox as a socket would copy them, so the
receiver never shares memory with the sender. Nothing runs concurrently: when
one end waits on an empty inbox, its ``pump`` lets the other end work through
what it has received (see `splitrl.stages.twin`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

from .base import Transport
from .errors import TransportTimeout
from .wire import WireLimits

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    def __init__(self, *, name: str, timeout: float = 30.0, limits: WireLimits = WireLimits()) -> None:
        super().__init__(peer=name, timeout=timeout, limits=limits)
        self.inbox: deque[list[bytearray]] = deque()
        self.other: LocalTransport | None = None
        self.pump: Callable[[], None] | None = None
        """Called while our inbox is empty and the other end has messages to process."""

    @classmethod
    def pair(cls, name_a: str, name_b: str, **kwargs: Any) -> tuple["LocalTransport", "LocalTransport"]:
        """Two connected ends; ``a`` talks to the peer called ``name_b`` and vice versa."""
        a, b = cls(name=name_b, **kwargs), cls(name=name_a, **kwargs)
        a.other, b.other = b, a
        return a, b

    def _send_frames(self, frames: list[Any], timeout: float) -> None:
        if self.other is None or self.other._closed:
            raise TransportTimeout(f"could not send to {self.peer}: it is closed")
        self.other.inbox.append([bytearray(f) for f in frames])

    def _recv_frames(self, timeout: float) -> Sequence[Any]:
        while not self.inbox and self.pump is not None and self.other is not None and self.other.inbox:
            self.pump()
        if not self.inbox:
            raise TransportTimeout(f"no message from {self.peer}: nothing is pending in-process")
        return self.inbox.popleft()

    def _close(self) -> None:
        self.inbox.clear()
