"""Every codec turns every malformed message into a `CodecError` (a `ProtocolError`), fast, and leaves its
receiver's state alone: the valid message still decodes afterwards."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import zstandard

from splitrl.codecs import CodecError, Context
from splitrl.codecs.lossless import Zstd
from splitrl.transport.errors import ProtocolError

from .support import (
    SEED,
    SMALL,
    bwd_context,
    frame_stacks,
    gen,
    relu_features,
    same_bits,
    small_features,
    small_gradients,
    small_mask,
    valid_message,
)


def _garbage(n=40):
    return torch.randint(0, 256, (n,), generator=gen(SEED), dtype=torch.uint8)


def _set(d, key, value):
    d[key] = value


def _zlayout(meta, key, value):
    meta["z"][key] = value


# (id, spec, stream, x-maker, ctx-maker, observe?, corruption(parts, meta))
MALFORMED = [
    # dense casts
    ("fp32-missing", "fp32", "fwd", small_features, Context, lambda p, m: p.pop("")),
    ("fp32-dtype", "fp32", "fwd", small_features, Context, lambda p, m: _set(p, "", p[""].double())),
    ("fp32-shape", "fp32", "fwd", small_features, Context, lambda p, m: _set(p, "", p[""][:, :-1])),
    ("bf16-as-fp16", "bf16", "fwd", small_features, Context, lambda p, m: _set(p, "", p[""].half())),
    ("bf16-flat", "bf16", "bwd", small_gradients, Context, lambda p, m: _set(p, "", p[""].reshape(-1))),
    ("int8-missing-scale", "int8", "bwd", small_gradients, Context, lambda p, m: p.pop("s")),
    ("int8-missing-codes", "int8", "bwd", small_gradients, Context, lambda p, m: p.pop("q")),
    ("int8-codes-uint8", "int8", "bwd", small_gradients, Context, lambda p, m: _set(p, "q", p["q"].view(torch.uint8))),
    ("int8-scale-short", "int8", "bwd", small_gradients, Context, lambda p, m: _set(p, "s", p["s"][:-1])),
    ("int8-scale-f64", "int8", "bwd", small_gradients, Context, lambda p, m: _set(p, "s", p["s"].double())),
    ("int8-scale-nan", "int8", "bwd", small_gradients, Context, lambda p, m: p["s"].__setitem__(3, float("nan"))),
    ("int8-scale-inf", "int8", "fwd", small_features, Context, lambda p, m: p["s"].__setitem__(0, float("-inf"))),
    # relu (sparse values, index bytes)
    ("relu-missing-i", "relu", "fwd", small_features, Context, lambda p, m: p.pop("i")),
    ("relu-missing-v", "relu", "fwd", small_features, Context, lambda p, m: p.pop("v")),
    ("relu-i-truncated", "relu", "fwd", small_features, Context, lambda p, m: _set(p, "i", p["i"][:-1])),
    ("relu-i-int8", "relu", "fwd", small_features, Context, lambda p, m: _set(p, "i", p["i"].view(torch.int8))),
    ("relu-i-2d", "relu", "fwd", small_features, Context, lambda p, m: _set(p, "i", p["i"].reshape(2, -1))),
    ("relu-v-short", "relu", "fwd", small_features, Context, lambda p, m: _set(p, "v", p["v"][:-1])),
    ("relu-v-bf16", "relu", "fwd", small_features, Context, lambda p, m: _set(p, "v", p["v"].bfloat16())),
    ("relu-k-big", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "k", 16 * 64 + 1)),
    ("relu-k-neg", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "k", -1)),
    ("relu-k-off-by-one", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "k", m["k"] - 1)),
    ("relu-k-float", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "k", float(m["k"]))),
    ("relu-k-str", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "k", str(m["k"]))),
    ("relu-k-bool", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "k", True)),
    ("relu-k-missing", "relu", "fwd", small_features, Context, lambda p, m: m.pop("k")),
    ("relu-k-list", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "k", [1])),
    ("relu-m-pairs", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "m", 2)),
    ("relu-m-other", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "m", 1 - m["m"])),
    ("relu-m-none", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "m", None)),
    ("relu-m-bool", "relu", "fwd", small_features, Context, lambda p, m: _set(m, "m", bool(m["m"]))),
    ("relu-int8-scale-nan", "relu:values=int8", "fwd", small_features, Context,
     lambda p, m: p["s"].__setitem__(0, float("nan"))),
    ("relu-int8-v-missing", "relu:values=int8", "fwd", small_features, Context, lambda p, m: p.pop("v")),
    # varint index: a truncated last value, a too-long value
    ("relu-varint-truncated", "relu", "fwd", lambda: small_features() * (torch.arange(64) % 32 == 0), Context,
     lambda p, m: _set(p, "i", torch.cat([p["i"], torch.tensor([0x80], dtype=torch.uint8)]))),
    ("relu-varint-overlong", "relu", "fwd", lambda: small_features() * (torch.arange(64) % 32 == 0), Context,
     lambda p, m: _set(p, "i", torch.tensor([0xFF] * 10 + [0x01] + [0] * (m["k"] - 1), dtype=torch.uint8))),
    ("relu-varint-past-end", "relu", "fwd", lambda: small_features() * (torch.arange(64) % 32 == 0), Context,
     lambda p, m: p["i"].__setitem__(-1, 127)),
    # ef
    ("ef-missing-i", "ef", "bwd", small_gradients, bwd_context, lambda p, m: p.pop("i")),
    ("ef-v-fp32", "ef", "bwd", small_gradients, bwd_context, lambda p, m: _set(p, "v", p["v"].float())),
    ("ef-k-over-slots", "ef", "bwd", small_gradients, bwd_context,
     lambda p, m: _set(m, "k", int(small_mask().sum()) + 1)),
    ("ef-i-truncated", "ef", "bwd", small_gradients, bwd_context, lambda p, m: _set(p, "i", p["i"][:-2])),
    ("ef-full-bad", "ef", "bwd", small_gradients, bwd_context, lambda p, m: _set(m, "full", True)),
    ("ef-int8-scale-inf", "ef:values=int8", "bwd", small_gradients, bwd_context,
     lambda p, m: p["s"].__setitem__(2, float("inf"))),
    # paper
    ("paper-missing-i", "paper:warm=0", "bwd", small_gradients, bwd_context, lambda p, m: p.pop("i")),
    ("paper-missing-v", "paper:warm=0", "bwd", small_gradients, bwd_context, lambda p, m: p.pop("v")),
    ("paper-row-out", "paper:warm=0", "bwd", small_gradients, bwd_context, lambda p, m: p["i"].__setitem__((0, 0), 16)),
    ("paper-col-out", "paper:warm=0", "bwd", small_gradients, bwd_context, lambda p, m: p["i"].__setitem__((1, 1), 64)),
    ("paper-col-neg", "paper:warm=0", "bwd", small_gradients, bwd_context, lambda p, m: p["i"].__setitem__((2, 1), -1)),
    ("paper-row-neg", "paper:warm=0", "bwd", small_gradients, bwd_context,
     lambda p, m: p["i"].__setitem__((2, 0), -32768)),
    ("paper-i-int32", "paper:warm=0", "bwd", small_gradients, bwd_context, lambda p, m: _set(p, "i", p["i"].int())),
    ("paper-i-3cols", "paper:warm=0", "bwd", small_gradients, bwd_context,
     lambda p, m: _set(p, "i", torch.zeros(p["i"].shape[0], 3, dtype=torch.int16))),
    ("paper-i-1d", "paper:warm=0", "bwd", small_gradients, bwd_context, lambda p, m: _set(p, "i", p["i"].reshape(-1))),
    ("paper-too-many", "paper:warm=0", "bwd", small_gradients, bwd_context,
     lambda p, m: (_set(p, "i", torch.zeros(16 * 64 + 1, 2, dtype=torch.int16)),
                   _set(p, "v", torch.zeros(16 * 64 + 1, dtype=torch.bfloat16)))),
    ("paper-v-count", "paper:warm=0", "bwd", small_gradients, bwd_context, lambda p, m: _set(p, "v", p["v"][:-1])),
    ("paper-full-wrong-shape", "paper", "bwd", small_gradients, lambda: Context(global_step=0),
     lambda p, m: _set(p, "", p[""][:-1])),
    ("paper-full-missing", "paper", "bwd", small_gradients, lambda: Context(global_step=0), lambda p, m: p.pop("")),
    # delta
    ("delta-q-missing", "delta", "fwd", small_features, lambda: Context(idx=torch.arange(16)), lambda p, m: p.pop("q")),
    ("delta-s-nan", "delta", "fwd", small_features, lambda: Context(idx=torch.arange(16)),
     lambda p, m: p["s"].__setitem__(0, float("nan"))),
    ("delta-q-shape", "delta", "fwd", small_features, lambda: Context(idx=torch.arange(16)),
     lambda p, m: _set(p, "q", p["q"][:8])),
    ("delta-topk-k", "delta:q=topk", "fwd", small_features, lambda: Context(idx=torch.arange(16)),
     lambda p, m: _set(m, "k", 10**9)),
    ("delta-bf16-d-dtype", "delta:q=bf16", "fwd", small_features, lambda: Context(idx=torch.arange(16)),
     lambda p, m: _set(p, "d", p["d"].float())),
    # zstd layer
    ("zstd-garbage", "fp32+zstd", "fwd", small_features, Context, lambda p, m: _set(p, "", _garbage())),
    ("zstd-empty", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _set(p, "", torch.zeros(0, dtype=torch.uint8))),
    ("zstd-truncated", "fp32+zstd", "fwd", small_features, Context, lambda p, m: _set(p, "", p[""][:-5])),
    ("zstd-missing-part", "fp32+zstd", "fwd", small_features, Context, lambda p, m: p.pop("")),
    ("zstd-part-int8", "fp32+zstd", "fwd", small_features, Context, lambda p, m: _set(p, "", p[""].view(torch.int8))),
    ("zstd-no-layout", "fp32+zstd", "fwd", small_features, Context, lambda p, m: m.pop("z")),
    ("zstd-layout-list", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _set(m, "z", [["float32", [16, 64]]])),
    ("zstd-layout-huge", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _zlayout(m, "", ["float32", [2**40]])),
    ("zstd-layout-huge-dims", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _zlayout(m, "", ["float32", [2**31, 2**31, 2**31]])),
    ("zstd-layout-neg", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _zlayout(m, "", ["float32", [-16, -64]])),
    ("zstd-layout-dtype", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _zlayout(m, "", ["complex64", [16, 64]])),
    ("zstd-layout-wrong-size", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _zlayout(m, "", ["float32", [16, 63]])),
    ("zstd-layout-wrong-dtype", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _zlayout(m, "", ["int32", [16, 64]])),
    ("zstd-layout-float-dim", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _zlayout(m, "", ["float32", [16.0, 64]])),
    ("zstd-layout-short", "fp32+zstd", "fwd", small_features, Context, lambda p, m: _zlayout(m, "", ["float32"])),
    ("zstd-layout-many", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: m["z"].update({f"x{i}": ["uint8", [1]] for i in range(9)})),
    ("zstd-layout-key-int", "fp32+zstd", "fwd", small_features, Context,
     lambda p, m: _set(m, "z", {0: ["float32", [16, 64]]})),
    ("zstd-inner-meta", "relu+zstd", "fwd", small_features, Context, lambda p, m: _set(m, "k", -3)),
    ("zstd-swapped-parts", "relu+zstd", "fwd", small_features, Context, lambda p, m: p.update(i=p["v"], v=p["i"])),
    # frames
    ("frames-full-out", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: _set(m, "full", [0, 2])),
    ("frames-full-neg", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: _set(m, "full", [-1, 1])),
    ("frames-full-dup", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: _set(m, "full", [0, 0])),
    ("frames-full-str", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: _set(m, "full", ["0", 1])),
    ("frames-full-float", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: _set(m, "full", [0.0, 1])),
    ("frames-full-not-list", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: _set(m, "full", 3)),
    ("frames-full-missing", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: m.pop("full")),
    ("frames-no-earlier-stack", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: _set(m, "full", [0])),
    ("frames-garbage", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: _set(p, "z", _garbage())),
    ("frames-too-few-bytes", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)),
     lambda p, m: _set(p, "z", torch.frombuffer(bytearray(zstandard.ZstdCompressor().compress(bytes(64 * 7))),
                                                 dtype=torch.uint8))),
    ("frames-too-many-bytes", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)),
     lambda p, m: _set(p, "z", torch.frombuffer(bytearray(zstandard.ZstdCompressor().compress(bytes(64 * 9))),
                                                 dtype=torch.uint8))),
    ("frames-missing-z", "frames", "rollout", lambda: frame_stacks(2, 4, 8, 8, SEED),
     lambda: Context(envs=torch.arange(2)), lambda p, m: p.pop("z")),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_raises_codec_error(case):
    _, spec, stream, make_x, make_ctx, corrupt = case
    x, ctx = make_x(), make_ctx()
    observe = (torch.arange(16), relu_features(*SMALL, SEED + 3)) if spec.startswith("delta") else None
    r, parts, meta, recon = valid_message(spec, stream, x, ctx, observe)
    saved = copy.deepcopy(r.__dict__) if not isinstance(r, Zstd) else copy.deepcopy(r.inner.__dict__)
    good_parts, good_meta = {k: t.clone() for k, t in parts.items()}, copy.deepcopy(meta)
    corrupt(parts, meta)
    start = time.perf_counter()
    with pytest.raises(CodecError) as info:
        r.decode(parts, meta, ctx, tuple(x.shape), x.dtype)
    assert time.perf_counter() - start < 2.0
    assert isinstance(info.value, ProtocolError) and str(info.value)
    # the failed decode left the receiver's state alone: the valid message still decodes
    state = r.__dict__ if not isinstance(r, Zstd) else r.inner.__dict__
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
        elif isinstance(value, dict):
            assert set(state[key]) == set(value) and all(torch.equal(state[key][e], value[e]) for e in value), key
    out = r.decode(good_parts, good_meta, ctx, tuple(x.shape), x.dtype)
    assert same_bits(out, recon)
