"""What every codec is: a stateful encoder/decoder pair for one stream of tensors.

Both stages build the same codec from the same spec (the spec is in the shared
settings, so the handshake hash covers it). The sender calls `Codec.encode`, the
receiver `Codec.decode`, in the same order; a stateful codec (error feedback, the
delta cache) keeps its half of the state on each side. `Encoded.recon` is exactly
what the receiver's decode returns, so the sender can keep its own copy of the
receiver's view (the delta cache, the ReLU mask) without asking for it.

Codecs never report their size: the transport meters count the real bytes.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..transport.errors import ProtocolError

__all__ = ["STREAMS", "Context", "Encoded", "Codec", "CodecError", "Layout", "Param", "fits", "part"]

STREAMS = ("rollout", "fwd", "bwd")
"""rollout: features during the rollout; fwd: features of each training minibatch;
bwd: the gradient of the loss with respect to those features."""


class CodecError(ProtocolError):
    """A codec's parts do not decode: wrong names, shapes, dtypes or values."""


Layout = dict[str, tuple[torch.dtype, tuple[int | None, ...]]]
"""Tensors by name (a codec's parts, a message's tensors): each one's dtype and shape, ``None`` for a dimension
whose size depends on the values."""


def fits(shape: Any, dims: tuple[int | None, ...]) -> bool:
    """Whether ``shape`` (a tensor's, or a list a peer sent) is ``dims``, ``None`` there matching any size."""
    return len(shape) == len(dims) and all(want is None or got == want for got, want in zip(shape, dims))


@dataclass
class Context:
    """What both sides know about the tensor besides its bytes."""

    idx: torch.Tensor | None = None
    """Rollout-batch index of each row (training minibatches and rollout steps)."""
    envs: torch.Tensor | None = None
    """Env index of each row (rollout only)."""
    mask: torch.Tensor | None = None
    """bool, the tensor's shape: True where the receiver's activation is non-zero
    (bwd only; computed from the features as stage1 decoded them)."""
    global_step: int = 0
    """Env steps taken before this tensor (warm starts)."""


@dataclass
class Encoded:
    tensors: dict[str, torch.Tensor]
    """Parts to send, by short name ('' for a codec with a single part)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Small msgpack-able values (method ids, counts) for the header."""
    recon: torch.Tensor | None = None
    """The receiver's decode result, float32 (or the input's dtype for integer inputs)."""


@dataclass(frozen=True)
class Param:
    kind: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None


class Codec(ABC):
    """One stream's encoder or decoder (the same class is both)."""

    name: ClassVar[str]
    help: ClassVar[str]
    streams: ClassVar[tuple[str, ...]] = STREAMS
    params: ClassVar[dict[str, Param]] = {}
    state: ClassVar[tuple[str, ...]] = ()
    """Attributes that carry over from one message to the next (residuals, caches): what a checkpoint keeps."""
    carried: ClassVar[tuple[str, ...]] = ()
    """Attributes beyond `state` that a switch to another setting of the same codec keeps (`CodecSet.retune`):
    what the rollout filled and training still needs."""

    def __init__(self, **values: Any) -> None:
        for key, param in self.params.items():
            setattr(self, key, values.get(key, param.default))

    def spec(self) -> str:
        """The canonical spec string: name plus every parameter that differs from its default."""
        diff = [f"{k}={getattr(self, k)}" for k, p in self.params.items() if getattr(self, k) != p.default]
        return self.name + (":" + ",".join(diff) if diff else "")

    @abstractmethod
    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        """Parts for ``x``; updates the sender's state."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], meta: dict[str, Any], ctx: Context,
               shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor of ``shape``/``dtype`` the parts stand for; updates the receiver's state.

        Raises `CodecError` for parts that do not fit, before touching the state.
        """

    @abstractmethod
    def layout(self, shape: tuple[int, ...], dtype: torch.dtype, meta: dict[str, Any]) -> Layout:
        """The parts `encode` makes of a tensor of ``shape``/``dtype``, given the ``meta`` that came with them: what
        a receiver can check before it decodes anything (a fleet's stage1 at its door, `splitrl.stages.door`).
        Cheap, no state; `decode` checks the rest (the values, the sizes only they tell)."""

    def observe(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        """The rollout features of samples ``idx`` as stage1 sees them (the delta cache)."""

    def new_iteration(self) -> None:
        """A new rollout batch begins: drop per-sample state."""

    def state_dict(self) -> dict[str, Any]:
        return {key: copy.deepcopy(getattr(self, key)) for key in self.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self.state:
            setattr(self, key, copy.deepcopy(state[key]))


def part(parts: dict[str, torch.Tensor], key: str, dtype: torch.dtype, numel: int | None = None,
         shape: tuple[int, ...] | None = None, codec: str = "") -> torch.Tensor:
    """``parts[key]``, checked for dtype and size; a `CodecError` otherwise."""
    t = parts.get(key)
    label = f"codec {codec!r}: part {key!r}"
    if t is None:
        raise CodecError(f"{label} is missing (got {sorted(parts)})")
    if t.dtype != dtype or (shape is not None and tuple(t.shape) != tuple(shape)):
        want = f"{dtype} {list(shape)}" if shape is not None else str(dtype)
        raise CodecError(f"{label}: expected {want}, got {t.dtype} {list(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise CodecError(f"{label}: expected {numel} elements, got {t.numel()}")
    return t
