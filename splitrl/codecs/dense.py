"""Dense codecs: plain casts and 8-bit quantisation with one scale per row."""

from __future__ import annotations

from typing import Any

import torch

from .base import Codec, CodecError, Context, Encoded, Layout, part

__all__ = ["Cast", "Fp32", "Bf16", "Fp16", "Int8", "quantise8", "dequantise8", "row_scales", "encode8", "decode8", "check_meta_int", "VALUE_DTYPES"]

VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Cast(Codec):
    """Floating tensors travel as ``wire``; anything else (uint8 pixels) as it is."""

    wire: torch.dtype = torch.float32

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        if not x.is_floating_point():
            return Encoded({"": x}, recon=x)
        sent = x.detach().to(self.wire)
        return Encoded({"": sent}, recon=sent.to(x.dtype))

    def layout(self, shape, dtype, meta) -> Layout:
        return {"": (self.wire if dtype.is_floating_point else dtype, tuple(shape))}

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        wire = self.wire if dtype.is_floating_point else dtype
        return part(parts, "", wire, shape=shape, codec=self.name).to(dtype)


class Fp32(Cast):
    name, help = "fp32", "float32 as is (lossless; the default)"
    wire = torch.float32


class Bf16(Cast):
    name, help = "bf16", "cast to bfloat16 (2 bytes, 8-bit mantissa, float32's range)"
    wire = torch.bfloat16


class Fp16(Cast):
    name, help = "fp16", "cast to float16 (2 bytes, 11-bit mantissa, overflows above 65504)"
    wire = torch.float16


def row_scales(absmax: torch.Tensor, amin: torch.Tensor) -> torch.Tensor:
    """Signed per-row scales from each row's max |x| and min x.

    A row with no negative entry (ReLU features) uses all 256 codes as uint8-style
    offsets 0..255 stored in int8 as code - 128; otherwise codes are -127..127. The
    sign of the scale says which: negative scale means unsigned codes.
    """
    unsigned = amin >= 0
    levels = torch.where(unsigned, torch.tensor(255.0), torch.tensor(127.0))
    scale = torch.where(absmax > 0, absmax / levels, torch.ones_like(absmax))
    return torch.where(unsigned, -scale, scale)


def encode8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes of ``values`` with the signed ``scale`` of each one (broadcast)."""
    codes = torch.round(values / scale.abs())
    return torch.where(scale < 0, codes - 128, codes).clamp(-128, 127).to(torch.int8)


def decode8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values of int8 ``codes`` with the signed ``scale`` of each one (broadcast)."""
    return torch.where(scale < 0, codes.float() + 128, codes.float()) * scale.abs()


def quantise8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) for a 2-D float tensor, one signed scale per row (see `row_scales`)."""
    x = x.detach().float()
    scale = row_scales(x.abs().amax(dim=1), x.amin(dim=1))
    return encode8(x, scale[:, None]), scale


def dequantise8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantise8`: ``codes`` (R, C) int8, ``scale`` (R,) float32."""
    return decode8(codes, scale[:, None])


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if len(shape) >= 2 else 1


class Int8(Codec):
    name = "int8"
    help = "8 bits per value, one float32 scale per row (unsigned codes for rows without negatives)"

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        rows = _rows(tuple(x.shape))
        codes, scale = quantise8(x.reshape(rows, -1))
        return Encoded({"q": codes.reshape(x.shape), "s": scale}, recon=dequantise8(codes, scale).reshape(x.shape))

    def layout(self, shape, dtype, meta) -> Layout:
        return {"q": (torch.int8, tuple(shape)), "s": (torch.float32, (_rows(shape),))}

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        rows = _rows(shape)
        codes = part(parts, "q", torch.int8, shape=shape, codec=self.name)
        scale = part(parts, "s", torch.float32, shape=(rows,), codec=self.name)
        if not bool(torch.isfinite(scale).all()):
            raise CodecError("codec 'int8': non-finite scale")
        return dequantise8(codes.reshape(rows, -1), scale).reshape(shape).to(dtype)


def check_meta_int(meta: dict[str, Any], key: str, low: int, high: int, codec: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise CodecError(f"codec {codec!r}: header {key!r} must be an int in [{low}, {high}], got {value!r}")
    return value

