"""An in-process link for the single-process twin: same framing, same meters, no socket.

Frames are copied into the peer's inbox as a socket would copy them, so the
receiver never shares memory with the sender. The two ends may be used from two
threads (the twin runs stage1's loop on its own thread); a receive waits on the
inbox up to its timeout, as a socket would.
"""

from __future__ import annotations

import queue
from typing import Any, Sequence

from .base import Transport
from .errors import TransportTimeout
from .wire import WireLimits

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    def __init__(self, *, name: str, timeout: float = 30.0, limits: WireLimits = WireLimits()) -> None:
        super().__init__(peer=name, timeout=timeout, limits=limits)
        self.inbox: queue.SimpleQueue[list[bytearray]] = queue.SimpleQueue()
        self.other: LocalTransport | None = None

    @classmethod
    def pair(cls, name_a: str, name_b: str, **kwargs: Any) -> tuple["LocalTransport", "LocalTransport"]:
        """Two connected ends; ``a`` talks to the peer called ``name_b`` and vice versa."""
        a, b = cls(name=name_b, **kwargs), cls(name=name_a, **kwargs)
        a.other, b.other = b, a
        return a, b

    def _send_frames(self, frames: list[Any], timeout: float) -> None:
        if self.other is None or self.other._closed:
            raise TransportTimeout(f"could not send to {self.peer}: it is closed")
        self.other.inbox.put([bytearray(f) for f in frames])

    def _recv_frames(self, timeout: float) -> Sequence[Any]:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no message from {self.peer} within {timeout:g} s") from None

    def pending(self) -> bool:
        return not self.inbox.empty()

    def _close(self) -> None:
        while True:
            try:
                self.inbox.get_nowait()
            except queue.Empty:
                return
