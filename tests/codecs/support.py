"""What the codec tests share: seeded tensors, a codec's sender and receiver (two instances, as in two
processes), sending one message between them, and a small valid message to corrupt.

Shapes are realistic where it matters (a minibatch is 128 x 4096 float32 features:
ReLU outputs, about half zeros; gradients are randn * 1e-3) and small elsewhere.
Every random tensor comes from a seeded generator.
"""

from __future__ import annotations

import copy

import torch

from splitrl.codecs import Context, Encoded, parse_codec

__all__ = [
    "SEED", "B", "F", "SMALL", "gen", "relu_features", "gradients", "pair", "nbytes", "wire_copy", "send",
    "same_bits", "frame_stacks", "valid_message", "small_features", "small_gradients", "small_mask", "bwd_context",
]

torch.set_num_threads(1)

SEED = 4242
B, F = 128, 4096  # one training minibatch of features: 128 samples x 4096 floats
SMALL = (16, 64)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def relu_features(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.relu(torch.randn(rows, cols, generator=gen(seed)))


def gradients(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen(seed)) * 1e-3


def pair(spec: str, stream: str):
    """Sender and receiver: two independent instances, as in two processes."""
    return parse_codec(spec, stream), parse_codec(spec, stream)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def wire_copy(enc: Encoded) -> tuple[dict[str, torch.Tensor], dict]:
    """What the receiver gets: copies of the parts (no aliasing with the sender's tensors)."""
    return {k: t.clone() for k, t in enc.tensors.items()}, copy.deepcopy(enc.meta)


def send(sender, receiver, x: torch.Tensor, ctx: Context, rctx: Context | None = None):
    """Encode on the sender, decode on the receiver; returns (Encoded, decoded)."""
    enc = sender.encode(x, ctx)
    parts, meta = wire_copy(enc)
    out = receiver.decode(parts, meta, rctx if rctx is not None else ctx, tuple(x.shape), x.dtype)
    return enc, out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (torch.equal treats -0.0 == 0.0 and fails on NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)


def frame_stacks(envs: int, stack: int, h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (envs, stack, h, w), generator=gen(seed), dtype=torch.uint8)


def valid_message(spec, stream, x, ctx, observe=None, warmup=0):
    """A receiver in step with its sender, and a valid message for it."""
    s, r = pair(spec, stream)
    if observe is not None:
        s.observe(*observe)
        r.observe(*observe)
    for _ in range(warmup):
        send(s, r, x, ctx)
    enc = s.encode(x, ctx)
    parts, meta = wire_copy(enc)
    return r, parts, meta, enc.recon


def small_features():
    return relu_features(*SMALL, SEED)


def small_gradients():
    return gradients(*SMALL, SEED)


def small_mask():
    return relu_features(*SMALL, SEED + 5) != 0


def bwd_context():
    return Context(idx=torch.arange(16), mask=small_mask(), global_step=10**6)
