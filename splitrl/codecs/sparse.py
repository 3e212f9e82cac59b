"""Sparse codecs: send some entries, say which with the cheapest index coding.

- `ReluSparse` (``relu``): the non-zero entries of ReLU features, exactly or quantised.
- `Paper` (``paper``): the paper's gradient accumulation, step by step (Section IV-C).
- `TopKErrorFeedback` (``ef``): top-k with a residual kept per rollout sample, ReLU-aware.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Codec, CodecError, Context, Encoded, Layout, Param, part
from .dense import VALUE_DTYPES, check_meta_int, decode8, encode8, row_scales
from .indexcoding import BITMASK, decode_positions, encode_positions

__all__ = ["ReluSparse", "Paper", "TopKErrorFeedback", "pack_selected", "unpack_selected", "selected_layout"]

VALUE_FORMATS = ("fp32", "bf16", "fp16", "int8")


def _as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, math.prod(shape) // max(rows, 1)


def pack_selected(x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor | None, fmt: str) -> Encoded:
    """Send ``x``'s entries at slot positions ``pos`` (sorted, int64).

    ``slots`` maps slot positions to flat positions in ``x`` (None: the slots are
    all of ``x``'s entries). The positions go out as a bitmask or delta varints,
    whichever is smaller; the values as ``fmt`` (int8: one scale per row of ``x``).
    """
    rows, cols = _as_2d(tuple(x.shape))
    n_slots = x.numel() if slots is None else slots.numel()
    method, buf = encode_positions(pos.numpy(), n_slots)
    flat = pos if slots is None else slots[pos]
    values = x.detach().reshape(-1)[flat].float()
    parts: dict[str, torch.Tensor] = {"i": torch.from_numpy(buf)}
    if fmt == "int8":  # one scale per row of x, as `quantise8`
        row = flat // cols
        absmax = torch.zeros(rows).scatter_reduce_(0, row, values.abs(), "amax")
        amin = torch.zeros(rows).scatter_reduce_(0, row, values, "amin", include_self=False)
        scale = row_scales(absmax, amin)
        codes = encode8(values, scale[row])
        parts.update(v=codes, s=scale)
        decoded = decode8(codes, scale[row])
    else:
        parts["v"] = values.to(VALUE_DTYPES[fmt])
        decoded = parts["v"].float()
    recon = torch.zeros(x.numel())
    recon[flat] = decoded
    return Encoded(parts, {"m": method, "k": int(pos.numel())}, recon.reshape(x.shape))


def unpack_selected(parts: dict[str, torch.Tensor], meta: dict[str, Any], slots: torch.Tensor | None,
                    shape: tuple[int, ...], fmt: str, codec: str) -> torch.Tensor:
    """Inverse of `pack_selected`, validating everything that came off the wire."""
    rows, cols = _as_2d(shape)
    numel = rows * cols
    n_slots = numel if slots is None else slots.numel()
    k = check_meta_int(meta, "k", 0, n_slots, codec)
    method = check_meta_int(meta, "m", 0, 1, codec)
    buf = part(parts, "i", torch.uint8, codec=codec)
    try:
        pos = torch.from_numpy(decode_positions(method, buf.numpy(), n_slots, count=k))
    except ValueError as exc:
        raise CodecError(f"codec {codec!r}: positions: {exc}") from None
    flat = pos if slots is None else slots[pos]
    if fmt == "int8":
        codes = part(parts, "v", torch.int8, numel=k, codec=codec)
        scale = part(parts, "s", torch.float32, shape=(rows,), codec=codec)
        if not bool(torch.isfinite(scale).all()):
            raise CodecError(f"codec {codec!r}: non-finite scale")
        values = decode8(codes.reshape(-1), scale[flat // cols])
    else:
        values = part(parts, "v", VALUE_DTYPES[fmt], numel=k, codec=codec).reshape(-1).float()
    out = torch.zeros(numel)
    out[flat] = values
    return out.reshape(shape)


def selected_layout(shape: tuple[int, ...], meta: dict[str, Any], n_slots: int | None, fmt: str,
                    codec: str) -> Layout:
    """`pack_selected`'s parts for a tensor of ``shape`` whose positions index ``n_slots`` slots (None: a number
    the receiver learns only as it decodes), as ``meta`` says they are: the values' count ``k`` and, for a
    bitmask (``m``), the index bytes are fixed; varints' bytes are not. `CodecError` for ``meta`` that cannot be
    right."""
    rows, _ = _as_2d(shape)
    k = check_meta_int(meta, "k", 0, math.prod(shape) if n_slots is None else n_slots, codec)
    method = check_meta_int(meta, "m", 0, 1, codec)
    index = ((n_slots + 7) // 8,) if method == BITMASK and n_slots is not None else (None,)
    if fmt == "int8":
        return {"i": (torch.uint8, index), "v": (torch.int8, (k,)), "s": (torch.float32, (rows,))}
    return {"i": (torch.uint8, index), "v": (VALUE_DTYPES[fmt], (k,))}


def _full(x: torch.Tensor) -> Encoded:
    sent = x.detach().float()
    return Encoded({"": sent}, {"full": True}, sent)


def _is_full(meta: dict[str, Any]) -> bool:
    return meta.get("full") is True


def _top_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    if k >= scores.numel():
        return torch.arange(scores.numel())
    return torch.topk(scores, k, sorted=False).indices.sort().values


class ReluSparse(Codec):
    name = "relu"
    help = "the non-zero entries only (ReLU features are ~50 % zeros), positions as bitmask or varints"
    streams = ("rollout", "fwd")
    params = {"values": Param(str, "fp32", "value format", VALUE_FORMATS)}

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        flat = x.detach().reshape(-1)
        return pack_selected(x, torch.nonzero(flat).squeeze(1), None, self.values)

    def layout(self, shape, dtype, meta) -> Layout:
        return selected_layout(shape, meta, math.prod(shape), self.values, self.name)

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        return unpack_selected(parts, meta, None, shape, self.values, self.name).to(dtype)


class Paper(Codec):
    """The paper's method, literally (Section IV-C, eqs. 3-6).

    stage1 keeps an accumulator G shaped like one minibatch's feature gradient
    (positional: row r of G collects row r of every minibatch, whichever sample
    that is). Per minibatch: G <- decay * G + grad; tau = quantile(|G|, p); send
    the entries with |G| >= tau as int16 (row, col) pairs and bfloat16 values;
    zero them in G. Until ``warm`` env steps, full float32 gradients instead.
    """

    name = "paper"
    help = "the paper's percentile-threshold gradient accumulation (int16 pairs + bf16 values)"
    streams = ("bwd",)
    params = {
        "p": Param(float, 0.90, "quantile of |G| at or above which entries are sent"),
        "decay": Param(float, 1.0, "G is multiplied by this before each minibatch's gradient is added"),
        "warm": Param(int, 30_000, "env steps of full float32 gradients before accumulation starts"),
    }

    state = ("G",)

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        if not 0.0 <= self.p <= 1.0 or not 0.0 <= self.decay <= 1.0 or self.warm < 0:
            raise ValueError(f"paper: need 0 <= p <= 1, 0 <= decay <= 1, warm >= 0; got {self.spec()}")
        self.G: torch.Tensor | None = None

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        if ctx.global_step < self.warm:
            return _full(x)
        rows, cols = _as_2d(tuple(x.shape))
        if rows > 32767 or cols > 32767:
            raise ValueError(f"paper: int16 coordinates cannot address a {rows} x {cols} gradient")
        grad = x.detach().float().reshape(rows, cols)
        if self.G is None or self.G.shape != grad.shape:
            self.G = torch.zeros_like(grad)
        if self.decay != 1.0:
            self.G.mul_(self.decay)
        self.G.add_(grad)
        tau = torch.quantile(self.G.abs().flatten(), self.p)
        mask = self.G.abs() >= tau
        coords = mask.nonzero()
        values = self.G[mask].to(torch.bfloat16)
        self.G[mask] = 0.0
        recon = torch.zeros(rows, cols)
        recon[mask] = values.float()
        return Encoded({"i": coords.to(torch.int16), "v": values}, {}, recon.reshape(x.shape))

    def layout(self, shape, dtype, meta) -> Layout:
        if _is_full(meta):
            return {"": (torch.float32, tuple(shape))}
        return {"i": (torch.int16, (None, 2)), "v": (torch.bfloat16, (None,))}

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        if _is_full(meta):
            return part(parts, "", torch.float32, shape=shape, codec=self.name).to(dtype)
        rows, cols = _as_2d(shape)
        coords = part(parts, "i", torch.int16, codec=self.name)
        if coords.dim() != 2 or coords.shape[1] != 2 or coords.shape[0] > rows * cols:
            raise CodecError(f"codec 'paper': part 'i' must be (k <= {rows * cols}, 2), got {list(coords.shape)}")
        values = part(parts, "v", torch.bfloat16, numel=coords.shape[0], codec=self.name)
        r, c = coords[:, 0].long(), coords[:, 1].long()
        if bool(((r < 0) | (r >= rows) | (c < 0) | (c >= cols)).any()):
            raise CodecError(f"codec 'paper': coordinates outside {rows} x {cols}")
        out = torch.zeros(rows, cols)
        out[r, c] = values.reshape(-1).float()
        return out.reshape(shape).to(dtype)


class TopKErrorFeedback(Codec):
    """Top-k with error feedback kept per rollout sample, ReLU-aware.

    The residual of sample j (what was accumulated for j and not yet sent)
    waits in a table keyed by j and is added back when j's gradient comes again,
    in the next epoch: it never lands on another sample's row as with the paper's
    positional G. With ``relu=1`` only entries where stage1's copy of the feature
    is non-zero are candidates: stage0's ReLU zeroes the others' gradient anyway,
    and both sides know where they are, so positions index the candidates only.
    The residual table is dropped when a new rollout batch begins.
    """

    name = "ef"
    help = "top-k gradient entries with per-sample error feedback, ReLU-aware; positions as bitmask or varints"
    streams = ("bwd",)
    params = {
        "density": Param(float, 0.05, "fraction of the gradient's entries sent per minibatch"),
        "values": Param(str, "bf16", "value format", VALUE_FORMATS),
        "relu": Param(int, 1, "only entries whose feature is non-zero are candidates (0: all)", (0, 1)),
        "warm": Param(int, 0, "env steps of full float32 gradients first"),
    }

    state = ("residual",)

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        if not 0.0 < self.density <= 1.0 or self.warm < 0:
            raise ValueError(f"ef: need 0 < density <= 1 and warm >= 0; got {self.spec()}")
        self.residual: torch.Tensor | None = None

    def new_iteration(self) -> None:
        self.residual = None

    def _slots(self, ctx: Context, numel: int) -> torch.Tensor | None:
        if not self.relu or ctx.mask is None:
            return None
        if ctx.mask.numel() != numel:
            raise CodecError(f"codec 'ef': ReLU mask has {ctx.mask.numel()} entries, the gradient {numel}")
        return torch.nonzero(ctx.mask.reshape(-1)).squeeze(1)

    def _rows_of(self, idx: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor:
        if idx is None:
            raise ValueError("ef: needs the minibatch's sample indices")
        need = int(idx.max()) + 1 if idx.numel() else 0
        if self.residual is None or self.residual.shape[0] < need or self.residual.shape[1] != cols:
            grown = torch.zeros(max(need, rows), cols)
            if self.residual is not None and self.residual.shape[1] == cols:
                grown[: self.residual.shape[0]] = self.residual
            self.residual = grown
        return idx

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        if ctx.global_step < self.warm:
            return _full(x)
        rows, cols = _as_2d(tuple(x.shape))
        idx = self._rows_of(ctx.idx, rows, cols)
        acc = x.detach().float().reshape(rows, cols) + self.residual[idx]
        slots = self._slots(ctx, acc.numel())
        if slots is not None:
            acc = acc * ctx.mask.reshape(rows, cols)
        scores = acc.reshape(-1).abs() if slots is None else acc.reshape(-1)[slots].abs()
        k = min(scores.numel(), math.ceil(self.density * acc.numel()))
        enc = pack_selected(acc, _top_positions(scores, k), slots, self.values)
        self.residual[idx] = acc - enc.recon
        enc.recon = enc.recon.reshape(x.shape)
        return enc

    def layout(self, shape, dtype, meta) -> Layout:
        if _is_full(meta):
            return {"": (torch.float32, tuple(shape))}
        # With relu=1 the positions index the entries the receiver's features make non-zero: known as it decodes.
        return selected_layout(shape, meta, None if self.relu else math.prod(shape), self.values, self.name)

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        if _is_full(meta):
            return part(parts, "", torch.float32, shape=shape, codec=self.name).to(dtype)
        slots = self._slots(ctx, math.prod(shape))
        return unpack_selected(parts, meta, slots, shape, self.values, self.name).to(dtype)

