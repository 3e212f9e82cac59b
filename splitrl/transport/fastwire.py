"""The wire's fast path: what one transport remembers of its messages, so as not to redo work `wire` would.

`FastWire` gives the frames of `wire.encode` and the decodes (messages and errors)
of `wire.decode`, byte for byte and error for error; tests/transport/test_fastwire.py
compares the two on mutated frames. Each transport makes its own: what one link
learnt never serves another, and a stranger's messages teach it nothing.

- Encoding: frame 0 up to the sequence number (`wire._prefix`) depends only on the
  kind, the session id and the tensors' names, dtypes and shapes; a message like an
  earlier one packs only its sequence number and header.
- Decoding: the layout of a session peer's message that passed the whole check is
  kept (docs/PROTOCOL.md section 5, "Layouts checked before"); a message whose
  frame 0 begins with a kept prefix is checked only in what follows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import msgpack
import torch

from .wire import (
    _DTYPE_NAMES,
    _ITEMSIZE,
    _MAX_SEQ,
    Message,
    WireLimits,
    _all_finite,
    _encode_parts,
    _header_frame,
    _message,
    _plain_header_problem,
    _prefix,
    _reject_ext,
    _specs,
    _tensor_from_frame,
    decode,
)

__all__ = ["FastWire"]

_PREFIXES_MAX = 1024
"""Most frame-0 prefixes an encoder keeps (emptied when full: a stream of ever new shapes, compressed frames',
cannot grow it)."""
_KNOWN_PER_KIND = 8
"""Most layouts (specs and session id) `FastWire._learn` keeps per kind, the oldest learnt replaced first."""
_KNOWN_KEYS = 256
"""Most kinds `FastWire._learn` keeps layouts of (emptied when full)."""
_LEARN_PER_KIND = 32
"""Layouts a kind may learn: one that changes more often (compressed frames' lengths) takes the whole check
without paying for learning each message too."""
_LEARN_PREFIX_MAX = 1024
"""Longest prefix `FastWire._learn` keeps: bounds the memory (at most 256 x 8 x 1 KiB) whatever the peer sends."""
_LEARN_DEPTH_MAX = 64
"""Deepest ``max_depth`` the known path serves: msgpack unpacks at most 1,024 levels, and a header unpacked
on its own sits one level shallower than inside frame 0, so a limit near that would let one more through."""
_UINT_WIDTH = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


@dataclass(frozen=True)
class _Layout:
    """What the whole check found of a message's specs and session, to skip next time (`FastWire._decode_known`)."""

    prefix: bytes  # frame 0 up to the sequence number (`wire._prefix`)
    kind: str
    specs: tuple[tuple[str, torch.dtype, int, list[int], int, int, bool], ...]
    # name, dtype, item size, shape, element count, byte length, whether the finite check applies
    sid: int | None
    tensor_bytes: int


class FastWire:
    """One transport's encoder and decoder under ``limits``: `wire.encode` and `wire.decode` with a memory.

    ``prefixes``: frame-0 prefixes by (kind, sid, (name, dtype, shape) per tensor).
    ``known``: layouts by frame 0's leading bytes up to the kind; ``learnt``: how
    many each such key has learnt. All three are bounded whatever a peer sends.
    """

    def __init__(self, limits: WireLimits) -> None:
        self.limits = limits
        self.prefixes: dict[tuple[Any, ...], bytes] = {}
        self.known: dict[bytes, tuple[_Layout, ...]] = {}
        self.learnt: dict[bytes, int] = {}

    def encode(
        self,
        kind: str,
        seq: int,
        header: Mapping[str, Any] | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        sid: int | None = None,
    ) -> list[Any]:
        """`wire.encode`, whose frame-0 prefix is packed once per layout."""
        packed_header, layout, frames = _encode_parts(kind, seq, header, tensors, sid)
        key = (kind, sid, *layout)
        prefix = self.prefixes.get(key)
        if prefix is None:
            prefix = _prefix(kind, _specs(layout), sid)
            if len(self.prefixes) >= _PREFIXES_MAX:
                self.prefixes.clear()
            self.prefixes[key] = prefix
        frames[0] = _header_frame(prefix, seq, packed_header)
        return frames

    def decode(self, frames: Sequence[Any], *, learn_for: int | None = None) -> Message:
        """`wire.decode` under this transport's limits.

        A message laid out as `wire.encode` writes it, whose kind, tensor specs and session id are those of
        one that took the whole check before and was learnt, skips the checks those passed and msgpack for
        all but its header; anything else, and anything this path is not sure of, takes the whole check.
        ``learn_for``: learn the layout of a message of this session that took the whole check (a transport
        asks for its session peer's: a stranger's cannot push them out or grow the cache).
        """
        if self.known and type(frames) in (list, tuple) and frames:
            msg = self._decode_known(frames)
            if msg is not None:
                return msg
        msg = decode(frames, self.limits)
        if learn_for is not None and msg.sid == learn_for:
            self._learn(frames[0], msg)
        return msg

    def _learn(self, header_frame: Any, msg: Message) -> None:
        """Keep the layout of ``msg`` (decoded from a message whose frame 0 is ``header_frame``) so that
        `decode` recognises the next message like it by its leading bytes, when frame 0 begins as
        `wire.encode` writes it."""
        limits = self.limits
        if (len(msg.kind) > 31  # not a fixstr: `_decode_known` finds the kind's length in the 7th byte
                or limits.max_depth > _LEARN_DEPTH_MAX or type(header_frame) not in (bytes, bytearray, memoryview)):
            return
        key = bytes(header_frame[: 7 + len(msg.kind)])
        learnt = self.learnt.get(key, 0)
        if learnt >= _LEARN_PER_KIND:
            return
        specs, rows = [], []
        for index, (name, tensor) in enumerate(msg.tensors.items(), start=1):
            dtype_name, shape = _DTYPE_NAMES[tensor.dtype], list(tensor.shape)
            specs.append([name, dtype_name, shape, index])
            rows.append((name, tensor.dtype, _ITEMSIZE[dtype_name], shape, tensor.numel(),
                         tensor.numel() * _ITEMSIZE[dtype_name], tensor.dtype.is_floating_point and limits.finite))
        prefix = _prefix(msg.kind, specs, msg.sid)
        if len(prefix) > _LEARN_PREFIX_MAX or bytes(header_frame[: len(prefix)]) != prefix:
            return  # too long to keep; or another encoder's key order or encodings: always the whole check
        known = self.known
        layouts = known.get(key, ())
        if any(layout.prefix == prefix for layout in layouts):
            return
        if len(known) >= _KNOWN_KEYS:
            known.clear()
            self.learnt.clear()
        self.learnt[key] = learnt + 1
        if learnt + 1 >= _LEARN_PER_KIND:
            known[key] = ()  # it changes too often to be worth trying
            return
        # A new tuple, not a list changed in place: another thread may be reading the old one.
        known[key] = (_Layout(prefix, msg.kind, tuple(rows), msg.sid, sum(row[5] for row in rows)),
                      *layouts[: _KNOWN_PER_KIND - 1])

    def _decode_known(self, frames: Sequence[Any]) -> Message | None:
        """The message if it is laid out as one of its kind's layouts in `known` (messages that passed the
        whole check under these limits) and everything that varies passes, else None: the whole check then
        decides, and says why.

        A layout's prefix is a complete msgpack encoding of the map's first keys, and msgpack is prefix-free: a
        frame that starts with those bytes holds exactly those values. What follows is checked here: ``s`` (an
        int in range), ``h`` (one msgpack map of plain data, reaching the frame's end), the frame count, each
        frame's length, writability and finite values, the message's size."""
        limits = self.limits
        raw = frames[0]
        kind = type(raw)
        if kind is bytes:
            head = raw
        elif kind is bytearray:
            if len(raw) > limits.max_header_bytes:
                return None
            head = bytes(raw)
        elif kind is memoryview:  # of bytes, as msgpack reads it (the whole check refuses wider items)
            if raw.nbytes > limits.max_header_bytes or raw.itemsize != 1 or not raw.c_contiguous:
                return None
            head = bytes(raw)
        else:
            return None
        if len(head) > limits.max_header_bytes or len(head) < 8 or not 0xA1 <= head[6] <= 0xBF:
            return None
        layouts = self.known.get(head[: 7 + head[6] - 0xA0], ())
        for layout in layouts:
            if head.startswith(layout.prefix):
                break
        else:
            return None
        pos = len(layout.prefix)
        if head[pos : pos + 2] != b"\xa1s" or pos + 2 >= len(head):
            return None
        first, pos = head[pos + 2], pos + 3
        if first < 0x80:
            seq = first
        else:
            width = _UINT_WIDTH.get(first)
            if width is None:
                return None
            seq, pos = int.from_bytes(head[pos : pos + width], "big"), pos + width
            if seq > _MAX_SEQ:
                return None
        if head[pos : pos + 2] != b"\xa1h":
            return None
        if head[pos + 2 :] == b"\x80":
            header: Any = {}
        else:
            try:
                header = msgpack.unpackb(head[pos + 2 :], raw=False, strict_map_key=True, use_list=True,
                                         ext_hook=_reject_ext, timestamp=0)
            except Exception:  # garbage, trailing bytes, an ext type: the whole check says which
                return None
            if type(header) is not dict or _plain_header_problem(header, limits.max_depth) is not None:
                return None
        specs = layout.specs
        if len(frames) != len(specs) + 1 or len(head) + layout.tensor_bytes > limits.max_message_bytes:
            return None
        tensors = {}
        for index, (name, dtype, itemsize, shape, numel, nbytes, finite) in enumerate(specs, start=1):
            frame = frames[index]
            kind = type(frame)
            if kind is memoryview:
                if frame.nbytes != nbytes or frame.readonly or frame.itemsize != 1 or not frame.c_contiguous:
                    return None
            elif kind is not bytearray or len(frame) != nbytes:
                return None
            tensor = tensors[name] = _tensor_from_frame(frame, dtype, itemsize, shape, numel)
            if finite and numel and not _all_finite(tensor, frame):
                return None
        return _message(layout.kind, header, tensors, seq, len(head) + layout.tensor_bytes, layout.sid)
