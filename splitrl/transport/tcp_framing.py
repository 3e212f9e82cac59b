"""The plain TCP framing (docs/PROTOCOL.md section 10): messages to buffers, and a byte stream back to messages.

Every message is a little-endian u32 frame count, then for each frame a
little-endian u64 byte length followed by exactly that many bytes. Writing is
`message_buffers` (the buffers for one ``sendmsg``, frames not copied) and
`framed` (the same as bytes); reading is `FrameReader`, which takes a message's
bytes as they arrive and checks each count and length against the `WireLimits`
before it allocates anything. Nothing here owns a socket.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any, Callable, Sequence

from .wire import WireLimits

__all__ = ["FrameReader", "OutOfSync", "framed", "message_buffers", "byte_view", "IOV_MAX", "SEND_FLAGS"]

_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_COUNT_AND_LENGTH = struct.Struct("<IQ")
# The most buffers one ``sendmsg`` takes.
try:
    IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
    IOV_MAX = 16
# Python ignores SIGPIPE already; the flag keeps that true inside embedding hosts too.
SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_STAGING_BYTES = 256 * 1024
"""Small frames and length prefixes are read through this buffer, many per syscall."""
_DIRECT_BYTES = 64 * 1024
"""A frame remainder at least this large is read straight into its own buffer."""
_UPFRONT_BYTES = 4 * 1024 * 1024
"""A frame's buffer starts at most this large and doubles as its bytes arrive, so a peer that announces a
large frame and sends little costs little."""


def byte_view(frame: Any) -> memoryview:
    """``frame`` as a flat view of unsigned bytes (no copy)."""
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def message_buffers(frames: Sequence[Any]) -> list[Any]:
    """One message as the buffers to write, in order: the prefixes packed, the frames as views (no copy).

    The count and the first length share one buffer; an empty frame adds only its length."""
    views = [byte_view(f) for f in frames]
    buffers: list[Any] = [_COUNT_AND_LENGTH.pack(len(views), len(views[0])) if views else _COUNT.pack(0)]
    for i, view in enumerate(views):
        if i:
            buffers.append(_LENGTH.pack(len(view)))
        if len(view):
            buffers.append(view)
    return buffers


def framed(frames: Sequence[Any]) -> list[bytes]:
    """One message in the plain TCP framing, as the buffers to write (docs/PROTOCOL.md section 10)."""
    out = [_COUNT.pack(len(frames))]
    for frame in frames:
        view = byte_view(frame)
        out += [_LENGTH.pack(len(view)), bytes(view)]
    return out


class OutOfSync(Exception):
    """A frame count or length beyond the limits: the stream can no longer be read as messages."""

    def __init__(self, what: str, expected: str, got: str) -> None:
        super().__init__(f"{what}: expected {expected}, got {got}")


class FrameReader:
    """Reads messages in the plain TCP framing off a byte stream, as their bytes arrive.

    `read` returns one message's frames, each a fresh ``bytearray`` (writable and malloc-aligned, so decode can
    wrap it without a copy). Its ``read_into`` fills a view with at least one byte and returns how many, or
    raises (a timeout, a closed stream): whatever has arrived stays here, and the next `read` continues the
    message. Memory follows the bytes that arrived, not the lengths announced: a frame's buffer starts at
    most `_UPFRONT_BYTES` and doubles as it fills. Counts and lengths beyond the `WireLimits` raise
    `OutOfSync` before anything is allocated; `reset` then forgets the stream.
    """

    def __init__(self) -> None:
        self._staging = bytearray(_STAGING_BYTES)
        self._sview = memoryview(self._staging)
        self._rpos = self._rend = 0
        self._reset_message()

    def reset(self) -> None:
        """Forget what is buffered and any partial message: the stream is gone or cannot be trusted."""
        self._rpos = self._rend = 0
        self._reset_message()

    def buffered(self) -> int:
        """Bytes of an unfinished message received so far, its prefixes counted."""
        return self._partial_bytes() + (self._rend - self._rpos)

    def _reset_message(self) -> None:
        self._nframes: int | None = None
        self._frames: list[bytearray] = []
        self._current: memoryview | None = None
        self._filled = 0
        self._want = 0
        self._message_bytes = 0

    def _partial_bytes(self) -> int:
        if self._nframes is None:
            return 0
        done = self._frames[:-1] if self._current is not None else self._frames
        return _COUNT.size + _LENGTH.size * len(self._frames) + sum(map(len, done)) + (self._filled if self._current is not None else 0)

    def _fill(self, read_into: Callable[[memoryview], int]) -> None:
        # Frame bytes are consumed as soon as they arrive, so what is left here is at
        # most a partial length prefix (< 8 bytes): moving it to the front is cheap.
        left = self._rend - self._rpos
        if self._rpos:
            self._staging[:left] = bytes(self._sview[self._rpos : self._rend])
            self._rpos, self._rend = 0, left
        self._rend += read_into(self._sview[self._rend :])

    def read(self, read_into: Callable[[memoryview], int], limits: WireLimits) -> list[bytearray]:
        """The next message's frames, read through ``read_into`` (see the class docstring)."""
        while True:
            avail = self._rend - self._rpos
            current = self._current
            if current is not None:
                need = len(current) - self._filled
                if avail:
                    n = min(need, avail)
                    current[self._filled : self._filled + n] = self._sview[self._rpos : self._rpos + n]
                    self._rpos += n
                    self._filled += n
                elif need >= _DIRECT_BYTES:
                    self._filled += read_into(current[self._filled :])
                else:
                    self._fill(read_into)
                if self._filled == len(current):
                    if self._filled < self._want:  # the bytes so far have come: make room for as many more
                        frame = self._frames[-1]
                        current.release()
                        frame.extend(bytes(min(self._want, 2 * len(frame)) - len(frame)))
                        self._current = memoryview(frame)
                    else:
                        self._current = None
                continue
            if self._nframes is None:
                if avail < _COUNT.size:
                    self._fill(read_into)
                    continue
                (count,) = _COUNT.unpack_from(self._staging, self._rpos)
                if not 1 <= count <= limits.max_tensors + 1:
                    raise OutOfSync(
                        "frame count", f"1 to {limits.max_tensors + 1} (header + at most {limits.max_tensors} tensors)", str(count)
                    )
                self._rpos += _COUNT.size
                self._nframes = count
                continue
            if len(self._frames) == self._nframes:
                frames = self._frames
                self._reset_message()
                return frames
            if avail < _LENGTH.size:
                self._fill(read_into)
                continue
            (length,) = _LENGTH.unpack_from(self._staging, self._rpos)
            index = len(self._frames)
            cap = limits.max_header_bytes if index == 0 else limits.max_tensor_bytes
            if length > cap:
                what = "header frame length" if index == 0 else f"frame #{index} length"
                raise OutOfSync(what, f"at most {cap} bytes", f"{length} bytes")
            if self._message_bytes + length > limits.max_message_bytes:
                raise OutOfSync(
                    "message size", f"at most {limits.max_message_bytes} bytes", f"more than {self._message_bytes + length} bytes"
                )
            self._rpos += _LENGTH.size
            self._message_bytes += length
            # A fresh bytearray per frame: writable and malloc-aligned, so decode can wrap it without a copy.
            frame = bytearray(min(length, _UPFRONT_BYTES))
            self._frames.append(frame)
            self._want = length
            if length:
                self._current = memoryview(frame)
                self._filled = 0
