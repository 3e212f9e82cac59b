"""Wire codecs: what crosses the link for features and gradients, and how small.

A spec is ``NAME[:key=value,...][+zstd[:level=N]]``, for example ``bf16``,
``paper:p=0.99,decay=0.99``, ``ef:density=0.02,values=int8``,
``delta:q=topk,density=0.05`` or ``relu:values=bf16+zstd``. Each stage builds a
`CodecSet` from the shared settings: one codec per stream (rollout features,
training features, training gradients).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..devices import to_device, to_host
from .base import STREAMS, Codec, CodecError, Context, Encoded, Layout, Param, fits
from .delta import Delta, RolloutView
from .dense import Bf16, Fp16, Fp32, Int8
from .lossless import Frames, Zstd
from .sparse import TopKErrorFeedback, Paper, ReluSparse

__all__ = ["CODECS", "STREAMS", "Codec", "CodecError", "CodecSet", "Context", "Encoded", "Layout", "Param",
           "RolloutView", "fits", "parse_codec", "catalogue"]

CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (Fp32, Bf16, Fp16, Int8, ReluSparse, Delta, Paper, TopKErrorFeedback, Frames)
}


def _parse_params(cls: type[Codec], text: str, spec: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, eq, raw = item.partition("=")
        param = cls.params.get(key.strip())
        if not eq or param is None:
            known = ", ".join(cls.params) or "none"
            raise ValueError(f"codec {spec!r}: unknown parameter {item!r} for {cls.name!r} (parameters: {known})")
        try:
            value = param.kind(raw.strip())
        except ValueError:
            raise ValueError(f"codec {spec!r}: {key}={raw!r} is not a {param.kind.__name__}") from None
        if param.choices is not None and value not in param.choices:
            raise ValueError(f"codec {spec!r}: {key} must be one of {', '.join(map(str, param.choices))}")
        values[key.strip()] = value
    return values


def parse_codec(spec: str, stream: str) -> Codec:
    """A fresh codec for ``stream`` from ``spec``; ValueError naming what is wrong."""
    base, plus, layer = spec.strip().partition("+")
    name, _, params = base.partition(":")
    cls = CODECS.get(name.strip())
    if cls is None:
        raise ValueError(f"codec {spec!r}: unknown codec {name!r} (codecs: {', '.join(CODECS)})")
    if stream not in cls.streams:
        raise ValueError(f"codec {spec!r}: {cls.name!r} cannot carry the {stream} stream (only {', '.join(cls.streams)})")
    codec = cls(**_parse_params(cls, params, spec))
    if plus:
        lname, _, lparams = layer.partition(":")
        if lname.strip() != "zstd":
            raise ValueError(f"codec {spec!r}: unknown layer {lname!r} (only '+zstd')")
        codec = Zstd(codec, **_parse_params(Zstd, lparams, spec))
    return codec


def catalogue() -> str:
    """Every codec with its streams and parameters, as `splitrl codecs` prints it."""
    lines = []
    for cls in list(CODECS.values()) + [Zstd]:
        params = ",".join(f"{k}={p.default}" for k, p in cls.params.items())
        streams = "any" if cls is Zstd else "/".join(cls.streams)
        lines.append(f"{cls.name}{':' + params if params else ''} [{streams}]: {cls.help}")
    return "\n".join(lines)


class CodecSet:
    """One side's codecs for the three streams, and how their parts ride in a message.

    A codec's part ``''`` travels as the tensor's own name (so fp32 messages look
    exactly as without codecs); part ``p`` as ``name.p``. Non-empty codec metadata
    goes in the header under ``codec`` -> name.

    The codecs work in host memory, as the wire does: `pack` encodes the host copy of a tensor that may live on
    ``device`` (the side's: `splitrl.devices`), and `unpack` decodes on the host and hands the result to
    ``device``. Their state (residuals, caches, the rollout view) stays on the host. On the CPU both moves are
    no-ops.
    """

    def __init__(self, rollout: str = "fp32", fwd: str = "fp32", bwd: str = "fp32",
                 device: torch.device | str = "cpu") -> None:
        self.codecs = {"rollout": parse_codec(rollout, "rollout"), "fwd": parse_codec(fwd, "fwd"),
                       "bwd": parse_codec(bwd, "bwd")}
        self._view: RolloutView | None = None
        self.device = torch.device(device)
        """Where this side computes: `unpack`'s results go there."""

    def rollout_view(self) -> RolloutView:
        """Every rollout sample's features as stage1 decoded them, kept alike on both sides from now on."""
        if self._view is None:
            self._view = RolloutView("rollout view")
        return self._view

    def state_dict(self, *streams: str) -> dict[str, Any]:
        """What ``streams``' codecs (default: all) carry from one message to the next."""
        return {stream: self.codecs[stream].state_dict() for stream in streams or self.codecs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for stream, codec_state in state.items():
            self.codecs[stream].load_state_dict(codec_state)

    def __getitem__(self, stream: str) -> Codec:
        return self.codecs[stream]

    def retune(self, stream: str, spec: str) -> None:
        """Carry ``stream`` with ``spec`` from now on. A codec of the same kind takes over the old one's state
        (residuals, caches: the objects themselves, not copies); one of another kind starts afresh."""
        old, new = self.codecs[stream], parse_codec(spec, stream)
        if old.spec() == new.spec():
            return
        inner_old, inner_new = getattr(old, "inner", old), getattr(new, "inner", new)
        if type(inner_old) is type(inner_new):
            for key in (*inner_old.state, *inner_old.carried):
                setattr(inner_new, key, getattr(inner_old, key))
        self.codecs[stream] = new

    def new_iteration(self, *streams: str) -> None:
        """A new rollout batch begins for ``streams`` (default: all): their codecs drop per-sample state."""
        for stream in streams or self.codecs:
            self.codecs[stream].new_iteration()

    def pack(self, stream: str, name: str, x: torch.Tensor, ctx: Context,
             tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> torch.Tensor:
        """Encode ``x`` (its host copy) into ``tensors``/``header``; returns the receiver's view of it, on the host."""
        x, ctx = to_host(x), _on_host(ctx)
        enc = self.codecs[stream].encode(x, ctx)
        for key, t in enc.tensors.items():
            tensors[f"{name}.{key}" if key else name] = t
        if enc.meta:
            header.setdefault("codec", {})[name] = enc.meta
        recon = x if enc.recon is None else enc.recon
        if stream == "rollout":
            self.observe_rollout(ctx, recon)
        return recon

    def layout(self, stream: str, name: str, header: dict[str, Any], shape: tuple[int, ...],
               dtype: torch.dtype) -> Layout:
        """The message tensors that carry ``name``, a tensor of ``shape``/``dtype`` (`Codec.layout`, its parts named
        as `pack` names them), as a message with ``header`` says; `CodecError` for metadata that cannot be right."""
        meta = _meta(header, name)
        try:
            parts = self.codecs[stream].layout(tuple(shape), dtype, meta)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from None
        return {f"{name}.{key}" if key else name: spec for key, spec in parts.items()}

    def unpack(self, stream: str, name: str, tensors: dict[str, torch.Tensor], header: dict[str, Any],
               ctx: Context, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode ``name`` from a received message, on the host, and hand it to `device`; `CodecError` if it does
        not fit."""
        ctx = _on_host(ctx)
        prefix = name + "."
        parts = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
        if name in tensors:
            parts[""] = tensors[name]
        meta = _meta(header, name)
        try:
            x = self.codecs[stream].decode(parts, meta, ctx, tuple(shape), dtype)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from None
        if stream == "rollout":
            self.observe_rollout(ctx, x)
        return to_device(x, self.device)

    def observe_rollout(self, ctx: Context, x: torch.Tensor) -> None:
        """Rollout features of ``ctx.idx``'s samples as stage1 has them: they fill the delta cache
        and, if one was asked for, the rollout view."""
        if ctx.idx is not None:
            self.codecs["fwd"].observe(ctx.idx, x)
            if self._view is not None:
                self._view.observe(ctx.idx, x)


def _meta(header: dict[str, Any], name: str) -> dict[str, Any]:
    """The codec's metadata for tensor ``name`` in a message's ``header``; `CodecError` if it is no map."""
    meta = header.get("codec", {})
    meta = meta.get(name, {}) if isinstance(meta, dict) else None
    if not isinstance(meta, dict):
        raise CodecError(f"header 'codec' -> {name!r} must be a map")
    return meta


def _on_host(ctx: Context) -> Context:
    """``ctx`` with its tensors in host memory (itself where they are: always, on the CPU)."""
    moved = {key: to_host(t) for key in ("idx", "envs", "mask") if (t := getattr(ctx, key)) is not None
             and t.device.type != "cpu"}
    return dataclasses.replace(ctx, **moved) if moved else ctx
