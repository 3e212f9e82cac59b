"""The lossless codecs (splitrl/codecs/lossless.py): the bytes the +zstd layer saves, frames rebuilding the
stacks of a frame-stacked env, and zstd frames that claim more than the tensor can need."""

from __future__ import annotations

import struct

import pytest
import torch

from splitrl.codecs import CodecError, Context, parse_codec
from splitrl.codecs.lossless import Frames, compress

from .support import (
    B,
    F,
    SEED,
    SMALL,
    frame_stacks,
    gen,
    gradients,
    nbytes,
    pair,
    relu_features,
    send,
    small_features,
    valid_message,
    wire_copy,
)


def test_bytes_zstd():
    x = relu_features(B, F, SEED)
    plain = nbytes(parse_codec("fp32", "fwd").encode(x, Context()).tensors)
    z = nbytes(parse_codec("fp32+zstd", "fwd").encode(x, Context()).tensors)
    assert z < 0.75 * plain  # half the floats are zeros
    very = torch.zeros(B, F)
    very[:, ::64] = 1.0
    assert nbytes(parse_codec("fp32+zstd", "fwd").encode(very, Context()).tensors) < plain / 100
    # incompressible bf16 noise: zstd costs at most a small overhead
    g = gradients(B, F, SEED)
    raw = nbytes(parse_codec("bf16", "bwd").encode(g, Context()).tensors)
    assert nbytes(parse_codec("bf16+zstd", "bwd").encode(g, Context()).tensors) <= raw * 1.01 + 64


class FrameStackEnv:
    """gymnasium's FrameStackObservation for one env: reset repeats the first frame."""

    def __init__(self, stack: int, h: int, w: int, seed: int) -> None:
        self.g = gen(seed)
        self.stack, self.h, self.w = stack, h, w
        self.obs = None

    def frame(self) -> torch.Tensor:
        return torch.randint(0, 256, (self.h, self.w), generator=self.g, dtype=torch.uint8)

    def reset(self) -> torch.Tensor:
        self.obs = self.frame().expand(self.stack, self.h, self.w).clone()
        return self.obs

    def step(self) -> torch.Tensor:
        self.obs = torch.cat([self.obs[1:], self.frame()[None]])
        return self.obs


def in_step(s: Frames, r: Frames) -> bool:
    """Both sides hold the same last stack per env."""
    return set(s.last) == set(r.last) and all(torch.equal(s.last[e], r.last[e]) for e in s.last)


def test_frames_rebuild_stacks():
    envs = [FrameStackEnv(4, 8, 8, SEED), FrameStackEnv(4, 8, 8, SEED + 1)]
    s, r = pair("frames", "rollout")
    obs = torch.stack([e.reset() for e in envs])
    sizes = []
    fulls = []
    for t in range(10):
        ctx = Context(idx=torch.arange(2) + 2 * t, envs=torch.arange(2))
        enc, out = send(s, r, obs, ctx)
        assert out.dtype == torch.uint8 and torch.equal(out, obs), f"step {t}"
        assert in_step(s, r)
        assert enc.recon is obs or torch.equal(enc.recon, obs)
        sizes.append(nbytes(enc.tensors))
        fulls.append(enc.meta["full"])
        nxt = [e.step() for e in envs]
        if t == 4:
            # env 1 truncates: its final observation goes alone (final_features), then it resets
            final = nxt[1][None]
            fenc, fout = send(s, r, final, Context(envs=torch.tensor([1])))
            assert torch.equal(fout, final)
            assert in_step(s, r) and torch.equal(s.last[1], final[0])
            assert fenc.meta["full"] == []  # a continuation of env 1's stack
            nxt[1] = envs[1].reset()
        if t == 6:
            nxt[0] = envs[0].reset()  # env 0 terminates: no final observation
        obs = torch.stack(nxt)
    assert fulls[0] == [0, 1]
    assert fulls[5] == [1] and fulls[7] == [0]
    assert all(f == [] for i, f in enumerate(fulls) if i not in (0, 5, 7))
    # continuation steps send one (incompressible) frame per env instead of the stack
    cont = [sz for sz, f in zip(sizes, fulls) if f == []]
    assert max(cont) <= 2 * 64 + 16
    assert max(cont) < obs.numel() / 3  # the stacks as they are: 2 x 4 x 8 x 8 bytes
    # a reset stack repeats one frame: full, but zstd squeezes the repeats
    assert max(cont) < min(sizes[0], sizes[5], sizes[7]) <= 3 * 64 + 32


def test_frames_static_reset_is_still_exact():
    """A reset that looks like a continuation (constant frames) still rebuilds exactly."""
    s, r = pair("frames", "rollout")
    zero = torch.zeros(1, 4, 8, 8, dtype=torch.uint8)
    for _ in range(3):
        enc, out = send(s, r, zero, Context(envs=torch.tensor([0])))
        assert torch.equal(out, zero)
    other = zero.clone()
    other[0, :, 0, 0] = 7  # same frame four times: not a shift of the zeros
    enc, out = send(s, r, other, Context(envs=torch.tensor([0])))
    assert enc.meta["full"] == [0] and torch.equal(out, other)


def test_frames_needs_uint8_and_envs():
    c = parse_codec("frames", "rollout")
    with pytest.raises(ValueError):
        c.encode(torch.zeros(2, 4, 8, 8), Context(envs=torch.arange(2)))
    with pytest.raises(CodecError):
        c.encode(torch.zeros(2, 4, 8, 8, dtype=torch.uint8), Context(envs=None))
    with pytest.raises(CodecError):
        c.decode({}, {"full": []}, Context(envs=torch.arange(3)), (2, 4, 8, 8), torch.uint8)


@pytest.mark.parametrize("full", [[0, 0], [1, 1], [0, 1, 1]])
def test_frames_duplicate_full_rows(full):
    """With earlier stacks on both sides, a repeated row in 'full' would otherwise decode to garbage."""
    x, ctx = frame_stacks(2, 4, 8, 8, SEED), Context(envs=torch.arange(2))
    x2 = frame_stacks(2, 4, 8, 8, SEED + 1)  # not a continuation: both rows full again
    s2, r2 = pair("frames", "rollout")
    send(s2, r2, x, ctx)
    enc = s2.encode(x2, ctx)
    assert enc.meta["full"] == [0, 1]
    parts, meta = wire_copy(enc)
    meta["full"] = full
    with pytest.raises(CodecError):
        r2.decode(parts, meta, ctx, tuple(x2.shape), x2.dtype)
    meta["full"] = [1, 0]  # the same rows in another order are fine
    assert torch.equal(r2.decode(parts, meta, ctx, tuple(x2.shape), x2.dtype), x2)


def _huge_frame(claim: int = 1 << 62) -> torch.Tensor:
    """A zstd frame whose header claims ``claim`` bytes of content (single segment, 8-byte size)."""
    raw = struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", claim) + bytes([1, 0, 0])
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@pytest.mark.parametrize("dtype_field", [["float32"], {"a": 1}])
def test_zstd_layout_unhashable_dtype(dtype_field):
    r, parts, meta, _ = valid_message("fp32+zstd", "fwd", small_features(), Context())
    meta["z"][""] = [dtype_field, [16, 64]]
    with pytest.raises(CodecError):
        r.decode(parts, meta, Context(), SMALL, torch.float32)


@pytest.mark.parametrize("spec", ["fp32+zstd", "frames"])
def test_zstd_frame_claiming_huge_content(spec):
    if spec == "frames":
        x, ctx, key = frame_stacks(2, 4, 8, 8, SEED), Context(envs=torch.arange(2)), "z"
    else:
        x, ctx, key = small_features(), Context(), ""
    r, parts, meta, _ = valid_message(spec, "rollout" if spec == "frames" else "fwd", x, ctx)
    parts[key] = _huge_frame()
    with pytest.raises(CodecError):
        r.decode(parts, meta, ctx, tuple(x.shape), x.dtype)


def test_zstd_frame_claiming_too_much_within_memory_is_rejected():
    """A valid frame of more content than the tensor can need (but little enough to allocate) is an error, named
    by its claim: without the check it would decompress whole before the size is looked at."""
    r, parts, meta, _ = valid_message("fp32+zstd", "fwd", small_features(), Context())
    parts[""] = compress(torch.zeros(1 << 18), 3)  # 1 MiB of zeros, a few hundred bytes on the wire
    with pytest.raises(CodecError, match="claims 1048576 bytes"):
        r.decode(parts, meta, Context(), SMALL, torch.float32)
