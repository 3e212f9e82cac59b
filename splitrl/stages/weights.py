"""Named weights kept in step across the link as quantised changes against a view both sides keep.

The replica exchange keeps stage0's copy of the heads up to date with it (`splitrl.stages.replica`),
and a fleet's edges average their encoders through stage1 with it (``--encoder-sync avg``,
`splitrl.schedule.fleet`). Only changes cross, through the dense codecs (``int8``: one scale per row,
a bias being one row; ``bf16``; ``fp32``), so quantisation errors never accumulate: each side adds
the same decoded change to the same view.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..codecs import CodecError, Context, Layout
from ..codecs.dense import Bf16, Fp32, Int8
from ..devices import to_host

__all__ = ["WeightSync", "CODECS_BY_MODE", "update_layout"]

CODECS_BY_MODE = {c.name: c for c in (Fp32, Bf16, Int8)}


def update_layout(shapes: Iterable[tuple[str, tuple[int, ...]]], mode: str) -> Layout:
    """The tensors that carry every named weight's change (of each shape in ``shapes``) through the dense codec
    ``mode``, named as `WeightSync.encode` and `WeightSync.delta` name them: what a receiver checks before it
    decodes any."""
    codec = CODECS_BY_MODE[mode]()
    return {f"{name}.{key}" if key else name: spec for name, shape in shapes
            for key, spec in codec.layout(tuple(shape), torch.float32, {}).items()}


class WeightSync:
    """Named weights as the receiving side has them (a view both sides keep), and the messages that update it:
    the replica's heads (`splitrl.stages.replica`), a fleet's averaged encoder (``--encoder-sync avg``).

    Both sides start from the same named tensors (as built from the seed). The sender calls `encode` with the current weights, the receiver
    `decode` with what arrived; afterwards both views are bit-identical. Each
    tensor's change travels through the dense codec named by ``mode`` (``int8``:
    one scale per row, a bias being one row), its parts named ``NAME[.part]``.
    """

    def __init__(self, initial: Iterable[tuple[str, torch.Tensor]], mode: str = "int8", what: str = "heads sync") -> None:
        self.what = what
        """How errors name this sync."""
        if mode not in CODECS_BY_MODE:
            raise ValueError(f"{what}: mode must be one of {', '.join(CODECS_BY_MODE)}, got {mode!r}")
        self.codec = CODECS_BY_MODE[mode]()
        self.view = {name: to_host(t.detach().float()).clone() for name, t in initial}
        """In host memory, as the codecs work (the weights themselves may live on a device)."""

    def encode(self, current: Iterable[tuple[str, torch.Tensor]],
               names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Parts that bring the receiver's view of ``names`` (default: all) to ``current``
        (up to quantisation); updates ours."""
        current, selected = dict(current), self._selected(names)
        if not set(selected) <= set(current) <= set(self.view):
            raise ValueError(f"{self.what}: expected tensors {sorted(selected)} (of {sorted(self.view)}), "
                             f"got {sorted(current)}")
        parts: dict[str, torch.Tensor] = {}
        for name, base in selected.items():
            enc = self.codec.encode(to_host(current[name].detach().float()) - base, Context())
            parts.update({f"{name}.{key}" if key else name: t for key, t in enc.tensors.items()})
            base += enc.recon
        return parts

    def _selected(self, names: Iterable[str] | None) -> dict[str, torch.Tensor]:
        if names is None:
            return self.view
        names = list(names)
        unknown = sorted(set(names) - set(self.view))
        if unknown:
            raise ValueError(f"{self.what}: no weights named {unknown}")
        return {name: self.view[name] for name in names}

    def decode(self, parts: dict[str, torch.Tensor], names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Apply a received update of ``names`` (default: all); returns the view.
        `CodecError` (nothing changed) if it does not fit."""
        updated, used = {}, 0
        for name, base in self._selected(names).items():
            mine = {key[len(name) + 1:]: t for key, t in parts.items() if key.startswith(name + ".")}
            if name in parts:
                mine[""] = parts[name]
            used += len(mine)
            try:
                change = self.codec.decode(mine, {}, Context(), tuple(base.shape), torch.float32)
            except CodecError as exc:
                raise CodecError(f"{self.what}: {name!r}: {exc}") from None
            updated[name] = base + change
            # A finite but huge scale overflows here: refuse it before the view changes.
            if not bool(torch.isfinite(updated[name]).all()):
                raise CodecError(f"{self.what}: the update makes {name!r} non-finite")
        if used != len(parts):
            raise CodecError(f"{self.what}: {len(parts) - used} tensor(s) name no weight of {self.what.split()[0]}")
        self.view.update(updated)
        return self.view

    def delta(self, current: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Parts that carry ``current``'s change against the view, leaving the view as it is (an edge's change
        since the fleet last agreed, which stage1 averages with the others': `changes`)."""
        current = dict(current)
        if set(current) != set(self.view):
            raise ValueError(f"{self.what}: expected tensors {sorted(self.view)}, got {sorted(current)}")
        parts: dict[str, torch.Tensor] = {}
        for name, base in self.view.items():
            enc = self.codec.encode(to_host(current[name].detach().float()) - base, Context())
            parts.update({f"{name}.{key}" if key else name: t for key, t in enc.tensors.items()})
        return parts

    def changes(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The change each weight's `delta` parts carry, the view left as it is; `CodecError` if they do not fit."""
        view = dict(self.view)
        self.view = {name: torch.zeros_like(base) for name, base in view.items()}
        try:
            return {name: change.clone() for name, change in self.decode(parts).items()}
        finally:
            self.view = view
