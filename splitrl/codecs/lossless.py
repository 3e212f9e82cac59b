"""Lossless byte compression: the ``+zstd`` layer and the cloud setup's ``frames`` codec."""

from __future__ import annotations

import math
from typing import Any

import torch
import zstandard

from ..transport.errors import peer_repr
from ..transport.wire import DTYPES
from .base import Codec, CodecError, Context, Encoded, Layout, Param, fits, part

__all__ = ["Zstd", "Frames", "compress", "decompress"]

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


_COMPRESSORS: dict[int, zstandard.ZstdCompressor] = {}
_DECOMPRESSOR = zstandard.ZstdDecompressor()


def compress(t: torch.Tensor, level: int) -> torch.Tensor:
    """zstd-compressed bytes of ``t``'s memory, as a uint8 tensor."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    compressor = _COMPRESSORS.setdefault(level, zstandard.ZstdCompressor(level=level))
    return torch.frombuffer(bytearray(compressor.compress(raw)), dtype=torch.uint8)


def decompress(z: torch.Tensor, limit: int, codec: str) -> bytes:
    """Inverse of `compress`, refusing to produce more than ``limit`` bytes."""
    if z.numel() == 0:
        raise CodecError(f"codec {codec!r}: empty zstd part")
    data = z.numpy().tobytes()
    try:
        # zstandard allocates what the frame header claims and ignores max_output_size
        # when a size is given, so the claim is checked first. Our encoder always writes it.
        claimed = zstandard.frame_content_size(data)
        if claimed < 0:
            raise CodecError(f"codec {codec!r}: zstd frame does not state its size")
        if claimed > limit:
            raise CodecError(f"codec {codec!r}: zstd frame claims {claimed} bytes, more than the {limit} it can need")
        return _DECOMPRESSOR.decompress(data, max_output_size=max(limit, 1))
    except zstandard.ZstdError as exc:
        raise CodecError(f"codec {codec!r}: zstd: {exc}") from None


def _check_level(level: int, codec: str) -> None:
    if not 1 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"{codec}: zstd level must be in [1, {zstandard.MAX_COMPRESSION_LEVEL}], got {level}")


class Zstd(Codec):
    """Any codec's parts, each compressed with zstd (``SPEC+zstd``)."""

    name = "zstd"
    help = "suffix '+zstd' (level 3) or '+zstd:level=N': compress the parts of any codec losslessly"
    params = {"level": Param(int, 3, "zstd compression level")}

    def __init__(self, inner: Codec, **values: Any) -> None:
        super().__init__(**values)
        _check_level(self.level, "zstd")
        self.inner = inner
        self.streams = inner.streams

    def spec(self) -> str:
        return f"{self.inner.spec()}+{super().spec()}"

    def observe(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        self.inner.observe(idx, x)

    def new_iteration(self) -> None:
        self.inner.new_iteration()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        enc = self.inner.encode(x, ctx)
        layout = {k: [_DTYPE_NAMES[t.dtype], list(t.shape)] for k, t in enc.tensors.items()}
        parts = {k: compress(t, self.level) for k, t in enc.tensors.items()}
        return Encoded(parts, {**enc.meta, "z": layout}, enc.recon)

    def layout(self, shape, dtype, meta) -> Layout:
        inner = self.inner.layout(shape, dtype, {k: v for k, v in meta.items() if k != "z"})
        claimed = meta.get("z")  # the inner parts' dtypes and shapes, which must be the inner codec's
        if not isinstance(claimed, dict) or set(claimed) != set(inner):
            raise CodecError(f"codec 'zstd': header 'z' must name the parts {sorted(inner)}, got "
                             f"{peer_repr(claimed)}")
        for key, (dt, dims) in inner.items():
            spec = claimed[key]
            if not (isinstance(spec, list) and len(spec) == 2 and spec[0] == _DTYPE_NAMES[dt]
                    and isinstance(spec[1], list) and fits(spec[1], dims)):
                raise CodecError(f"codec 'zstd': part {key!r}: expected {_DTYPE_NAMES[dt]} "
                                 f"{[d if d is not None else '*' for d in dims]}, header 'z' says {peer_repr(spec)}")
        return {key: (torch.uint8, (None,)) for key in inner}  # each part's bytes, compressed

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        layout = meta.get("z")
        if not isinstance(layout, dict) or len(layout) > 8:
            raise CodecError("codec 'zstd': header 'z' must map parts to [dtype, shape]")
        # No inner part can be larger than the tensor it encodes, in float32, plus its index bytes.
        limit = 8 * math.prod(shape) + 65536
        inner_parts: dict[str, torch.Tensor] = {}
        for key, spec in layout.items():
            if not (isinstance(key, str) and isinstance(spec, list) and len(spec) == 2
                    and isinstance(spec[0], str) and spec[0] in DTYPES
                    and isinstance(spec[1], list) and all(isinstance(d, int) and d >= 0 for d in spec[1])):
                raise CodecError(f"codec 'zstd': bad layout for part {key!r}: {spec!r}")
            dt, dims = DTYPES[spec[0]], tuple(spec[1])
            size = math.prod(dims) * torch.empty((), dtype=dt).element_size()
            if size > limit:
                raise CodecError(f"codec 'zstd': part {key!r} claims {size} bytes, more than the tensor can need")
            raw = decompress(part(parts, key, torch.uint8, codec=self.name), limit, self.name)
            if len(raw) != size:
                raise CodecError(f"codec 'zstd': part {key!r} decompressed to {len(raw)} bytes, expected {size}")
            inner_parts[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(dims) if size \
                else torch.empty(dims, dtype=dt)
        inner_meta = {k: v for k, v in meta.items() if k != "z"}
        return self.inner.decode(inner_parts, inner_meta, ctx, shape, dtype)


class Frames(Codec):
    """The cloud setup done properly: with the cut before the first layer, send
    only the newest frame of each env's stack, zstd-compressed; stage1 rebuilds
    the stack from the frames it already has.

    Per env, the sender compares the stack with the one it sent last for that env:
    if the old frames are the new stack's older frames (the env went on), only
    the newest frame goes; otherwise (a reset, the first step) the whole stack.
    Both sides keep the last stack per env, so the rule needs no episode flags.
    """

    name = "frames"
    help = "cut=input only: the newest frame of each stack as uint8, zstd-compressed; stage1 rebuilds the stack"
    streams = ("rollout",)
    params = {"level": Param(int, 3, "zstd compression level")}

    state = ("last",)

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        _check_level(self.level, "frames")
        self.last: dict[int, torch.Tensor] = {}

    def _envs(self, ctx: Context, rows: int) -> list[int]:
        if ctx.envs is None or len(ctx.envs) != rows:
            raise CodecError("codec 'frames': needs the env index of every row")
        return [int(e) for e in ctx.envs]

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        if x.dtype != torch.uint8 or x.dim() < 3:
            raise ValueError("frames: expects uint8 observations (B, stack, H, W); use it with --cut input")
        pieces, full = [], []
        for row, env in enumerate(self._envs(ctx, x.shape[0])):
            prev = self.last.get(env)
            if prev is not None and torch.equal(prev[1:], x[row, :-1]):
                pieces.append(x[row, -1:])
            else:
                pieces.append(x[row])
                full.append(row)
            self.last[env] = x[row].clone()
        return Encoded({"z": compress(torch.cat(pieces), self.level)}, {"full": full}, x)

    def layout(self, shape, dtype, meta) -> Layout:
        return {"z": (torch.uint8, (None,))}

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        rows, stack, frame = shape[0], shape[1], math.prod(shape[2:])
        envs = self._envs(ctx, rows)
        full = meta.get("full")
        if not isinstance(full, list) or not all(isinstance(r, int) and 0 <= r < rows for r in full) \
                or len(set(full)) != len(full):
            raise CodecError(f"codec 'frames': header 'full' must list distinct rows < {rows}")
        missing = [envs[r] for r in range(rows) if r not in full and envs[r] not in self.last]
        if missing:
            raise CodecError(f"codec 'frames': no earlier stack for envs {missing} to continue")
        expected = (len(full) * stack + rows - len(full)) * frame
        raw = decompress(part(parts, "z", torch.uint8, codec=self.name), expected, self.name)
        if len(raw) != expected:
            raise CodecError(f"codec 'frames': {len(raw)} bytes of frames, expected {expected}")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = torch.empty((rows, stack) + tuple(shape[2:]), dtype=torch.uint8)
        at = 0
        for row, env in enumerate(envs):
            if row in full:
                out[row] = data[at: at + stack * frame].reshape(out.shape[1:])
                at += stack * frame
            else:
                out[row, :-1] = self.last[env][1:]
                out[row, -1] = data[at: at + frame].reshape(out.shape[2:])
                at += frame
            self.last[env] = out[row].clone()
        return out.to(dtype)
