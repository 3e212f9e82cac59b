"""A peer written from docs/PROTOCOL.md alone: pyzmq, msgpack and numpy, none of splitrl's wire code.

What a hostile (or merely foreign) client can do to a stage is tested with this, so the
tests show what the documented byte layout lets anyone send.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import msgpack
import numpy as np
import zmq

WIRE_DTYPES = {np.dtype("float32"): "float32", np.dtype("float16"): "float16", np.dtype("int64"): "int64",
               np.dtype("int32"): "int32", np.dtype("uint8"): "uint8", np.dtype("int8"): "int8",
               np.dtype("bool"): "bool"}
NUMPY_DTYPES = {name: dtype for dtype, name in WIRE_DTYPES.items()}


def frames(kind: str, seq: int, header: dict | None = None, tensors: Sequence[tuple[str, np.ndarray]] = (),
           sid: int | None = None) -> list[bytes]:
    """Section 1-3: a msgpack header map (with the session id ``i`` once there is one, section 2) and one raw
    little-endian C-order frame per tensor."""
    specs = [[name, WIRE_DTYPES[array.dtype], list(array.shape), i] for i, (name, array) in enumerate(tensors, 1)]
    outer = {"v": 1, "k": kind, "s": seq, "h": header or {}, "t": specs}
    if sid is not None:
        outer["i"] = sid
    return [msgpack.packb(outer)] + [np.ascontiguousarray(array).tobytes() for _, array in tensors]


def parse(parts: Sequence[bytes]) -> tuple[str, dict, dict[str, np.ndarray], int | None]:
    head = msgpack.unpackb(parts[0])
    tensors = {name: np.frombuffer(parts[index], dtype=NUMPY_DTYPES[dtype]).reshape(shape)
               for name, dtype, shape, index in head["t"]}
    return head["k"], head["h"], tensors, head.get("i")


def settings_hash(settings: dict) -> str:
    """Section 7: SHA-256 of the canonical JSON of the settings."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class RawPeer:
    """One side of section 8's socket pair: ``bind=False`` plays stage0 (connects), ``bind=True`` stage1."""

    def __init__(self, endpoint: str, *, bind: bool, timeout: float = 30.0, curve: dict[str, bytes] | None = None):
        host, port = endpoint.rsplit(":", 1)
        paired = f"{host}:{int(port) + 1}"
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        for sock in (self.push, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
            sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
            for option, value in (curve or {}).items():
                sock.setsockopt(getattr(zmq, option), value)
        if bind:
            self.pull.bind(endpoint)
            self.push.bind(paired)
        else:
            self.push.connect(endpoint)
            self.pull.connect(paired)
        self.seq = 0
        self.sid: int | None = None
        """The session id (section 7): chosen by us as stage1, learnt from stage1's hello as stage0."""

    def send(self, kind: str, header: dict | None = None, tensors: Sequence[tuple[str, np.ndarray]] = ()) -> None:
        self.push.send_multipart(frames(kind, self.seq, header, tensors, self.sid))
        self.seq += 1

    def send_raw(self, parts: Sequence[bytes]) -> None:
        self.push.send_multipart(list(parts))

    def recv(self) -> tuple[str, dict, dict[str, np.ndarray]]:
        kind, header, tensors, sid = parse(self.pull.recv_multipart())
        if kind == "hello" and self.sid is None and sid is not None:
            self.sid = sid  # stage1's answer opens the session
        return kind, header, tensors

    def hello(self, role: str, settings: dict[str, Any]) -> None:
        """Section 7: stage0 sends its settings; stage1 answers with their hash and a new session id."""
        if role == "stage1":
            self.sid = 0x5E55
            self.send("hello", {"proto": 1, "role": role, "settings_hash": settings_hash(settings)})
        else:
            self.send("hello", {"proto": 1, "role": role, "settings_hash": settings_hash(settings),
                                "settings": settings})

    def close(self) -> None:
        if not self.ctx.closed:
            self.push.close()
            self.pull.close()
            self.ctx.term()
