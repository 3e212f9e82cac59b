"""Delta coding of training features against a cache both stages keep (AQ-SGD).

Wang et al., "Fine-tuning Language Models over Slow Networks using Activation
Compression with Guarantees" (AQ-SGD, NeurIPS 2022): send the quantised change of
each sample's activation since the receiver last saw it, not the activation, so
quantisation errors do not pile up and the change shrinks as training settles.

Here the cache is filled by the rollout (both sides store the rollout features
as stage1 decoded them, see `Codec.observe`); in each training minibatch stage0
sends Q(f - view[idx]) and both sides add the decoded difference to view[idx].
stage1 trains on view[idx]. ``q=none`` sends nothing at all: stage1 trains on
the rollout's features for every epoch and only gradients flow back.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Codec, CodecError, Context, Encoded, Layout, Param, part
from .dense import VALUE_DTYPES, dequantise8, quantise8
from .sparse import pack_selected, selected_layout, unpack_selected

__all__ = ["Delta", "RolloutView"]


class RolloutView:
    """Each sample's rollout features as stage1 decoded them, kept alike on both sides."""

    def __init__(self, codec: str) -> None:
        self.codec = codec
        self.view: torch.Tensor | None = None
        self.filled: torch.Tensor | None = None

    def observe(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        rows = x.reshape(len(idx), -1).float()
        need = int(idx.max()) + 1
        if self.view is None or self.view.shape[0] < need or self.view.shape[1] != rows.shape[1]:
            # The rollout adds one step's rows at a time: grow geometrically, not by a row.
            size = max(need, 2 * self.view.shape[0] if self.view is not None else 0)
            view, filled = torch.zeros(size, rows.shape[1]), torch.zeros(size, dtype=torch.bool)
            if self.view is not None and self.view.shape[1] == rows.shape[1]:
                view[: self.view.shape[0]], filled[: self.view.shape[0]] = self.view, self.filled
            self.view, self.filled = view, filled
        self.view[idx] = rows
        self.filled[idx] = True

    def rows(self, idx: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """view[idx] for a tensor of ``shape`` (one row per sample); `CodecError` if any is missing."""
        if idx is None or self.view is None or len(idx) != shape[0] or int(idx.max()) >= self.view.shape[0] \
                or not bool(self.filled[idx].all()) or self.view.shape[1] != math.prod(shape[1:]):
            raise CodecError(f"codec {self.codec!r}: no cached rollout features for these samples "
                             "(the rollout stream must carry every sample first)")
        return self.view[idx]


class Delta(Codec):
    name = "delta"
    help = "training features as the quantised change against the rollout's cached view (AQ-SGD)"
    streams = ("fwd",)
    carried = ("cache",)
    params = {
        "q": Param(str, "int8", "how the change is sent ('none': not at all)",
                   ("none", "fp32", "bf16", "fp16", "int8", "topk")),
        "density": Param(float, 0.05, "with q=topk: fraction of entries sent (int8 values, per-row scale)"),
    }

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"delta: need 0 < density <= 1; got {self.spec()}")
        self.cache = RolloutView(self.name)

    @property
    def view(self) -> torch.Tensor | None:
        """Every sample's features as stage1 has them (None before the first rollout)."""
        return self.cache.view

    def observe(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        self.cache.observe(idx, x)

    def _base(self, ctx: Context, shape: tuple[int, ...]) -> torch.Tensor:
        return self.cache.rows(ctx.idx, shape)

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        shape = tuple(x.shape)
        base = self._base(ctx, shape)
        diff = x.detach().float().reshape(base.shape) - base
        if self.q == "none":
            enc = Encoded({}, {}, torch.zeros_like(base))
        elif self.q == "int8":
            codes, scale = quantise8(diff)
            enc = Encoded({"q": codes, "s": scale}, {}, dequantise8(codes, scale))
        elif self.q == "topk":
            k = math.ceil(self.density * diff.numel())
            pos = torch.topk(diff.reshape(-1).abs(), k, sorted=False).indices.sort().values
            enc = pack_selected(diff, pos, None, "int8")
        else:
            sent = diff.to(VALUE_DTYPES[self.q])
            enc = Encoded({"d": sent}, {}, sent.float())
        new = base + enc.recon.reshape(base.shape)
        self.cache.view[ctx.idx] = new
        enc.recon = new.reshape(shape)
        return enc

    def layout(self, shape, dtype, meta) -> Layout:
        rows = (shape[0], math.prod(shape[1:]))  # the cached view's rows: one per sample
        if self.q == "none":
            return {}
        if self.q == "int8":
            return {"q": (torch.int8, rows), "s": (torch.float32, rows[:1])}
        if self.q == "topk":
            return selected_layout(rows, meta, math.prod(rows), "int8", self.name)
        return {"d": (VALUE_DTYPES[self.q], rows)}

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        base = self._base(ctx, shape)
        if self.q == "none":
            change = torch.zeros_like(base)
        elif self.q == "int8":
            codes = part(parts, "q", torch.int8, shape=tuple(base.shape), codec=self.name)
            scale = part(parts, "s", torch.float32, shape=(base.shape[0],), codec=self.name)
            if not bool(torch.isfinite(scale).all()):
                raise CodecError("codec 'delta': non-finite scale")
            change = dequantise8(codes, scale)
        elif self.q == "topk":
            change = unpack_selected(parts, meta, None, tuple(base.shape), "int8", self.name)
        else:
            change = part(parts, "d", VALUE_DTYPES[self.q], shape=tuple(base.shape), codec=self.name).float()
        new = base + change
        self.cache.view[ctx.idx] = new
        return new.reshape(shape).to(dtype)
