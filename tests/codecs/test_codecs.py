"""Wire codecs: two instances of each codec (sender and receiver, as in two processes)
must agree bit for bit, stay within their stated error, send the bytes they claim,
keep their state in step, and turn every malformed message into a `CodecError`.

Shapes are realistic where it matters (a minibatch is 128 x 4096 float32 features:
ReLU outputs, about half zeros; gradients are randn * 1e-3) and small elsewhere.
Every random tensor comes from a seeded generator.
"""

from __future__ import annotations

import copy
import functools
import math
import struct
import time

import pytest
import torch
import zstandard

from splitrl.codecs import CODECS, CodecError, CodecSet, Context, Encoded, parse_codec
from splitrl.codecs.dense import dequantise8, quantise8
from splitrl.codecs.indexcoding import decode_positions
from splitrl.codecs.lossless import Frames, Zstd, compress
from splitrl.settings import CodecSettings, TrainSettings
from splitrl.transport.errors import ProtocolError

torch.set_num_threads(1)

SEED = 4242
B, F = 128, 4096  # one training minibatch of features: 128 samples x 4096 floats
BF16_REL = 2.0**-8  # round to nearest with an 8-bit significand
FP16_REL = 2.0**-11  # 11-bit significand (normal numbers)
FP16_SUBNORMAL_ABS = 2.0**-25  # half the spacing of float16 subnormals


# --------------------------------------------------------------------------- helpers


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


# --------------------------------------------------------------------------- 1. round trips

ROLLOUT_ROWS = 8  # num_envs rows per rollout step

BASE_SPECS = [(name, stream) for name, cls in CODECS.items() for stream in cls.streams]
EXTRA_SPECS = [
    ("relu:values=bf16", "fwd"),
    ("relu:values=fp16", "rollout"),
    ("relu:values=int8", "fwd"),
    ("ef:density=0.02,values=int8", "bwd"),
    ("ef:relu=0,values=fp32", "bwd"),
    ("ef:warm=1000", "bwd"),
    ("paper:p=0.99,decay=0.99,warm=0", "bwd"),
    ("delta:q=topk,density=0.05", "fwd"),
    ("delta:q=bf16", "fwd"),
    ("delta:q=fp16", "fwd"),
    ("delta:q=fp32", "fwd"),
    ("delta:q=none", "fwd"),
    ("fp32+zstd", "fwd"),
    ("fp32+zstd:level=1", "bwd"),
    ("int8+zstd", "bwd"),
    ("relu:values=bf16+zstd", "fwd"),
    ("ef:values=bf16+zstd", "bwd"),
    ("paper:warm=0+zstd", "bwd"),
    ("delta:q=int8+zstd", "fwd"),
    ("frames+zstd", "rollout"),
]
ALL_SPECS = BASE_SPECS + EXTRA_SPECS


def base_name(codec) -> str:
    return getattr(codec, "inner", codec).name


@functools.lru_cache(maxsize=4)
def _pre_activations(n: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(n, cols, generator=gen(seed))


class Scenario:
    """A few consecutive tensors of one stream, with everything the codec needs.

    Training minibatches have ``rows`` samples of ``cols`` features, drawn from a
    rollout batch of 4 x ``rows`` samples.
    """

    def __init__(self, spec: str, stream: str, seed: int = SEED, rows: int = B, cols: int = F) -> None:
        self.sender, self.receiver = pair(spec, stream)
        self.name = base_name(self.sender)
        self.stream = stream
        self.seed = seed
        self.rows, self.cols, self.n = rows, cols, 4 * rows
        self.pre = _pre_activations(self.n, cols, seed + 1)
        self.rollout = torch.relu(self.pre)
        if self.name == "delta":
            # Both sides cache the rollout features (as CodecSet does for the rollout stream).
            for t in range(0, self.n, rows // 2):
                idx = torch.arange(t, t + rows // 2)
                self.sender.observe(idx, self.rollout[idx])
                self.receiver.observe(idx, self.rollout[idx])

    def steps(self, n: int = 3):
        """(x, ctx) pairs; global_step 0 first (warm starts), then far beyond any warm start."""
        g = gen(self.seed + 2)
        for i in range(n):
            step = 0 if i == 0 else 10**6 + i
            if self.name == "frames":
                x = frame_stacks(2, 4, 8, 8, self.seed + 10 + i)
                if i == 2:  # the env went on: shift + append
                    x = torch.cat([prev[:, 1:], x[:, :1]], dim=1)
                prev = x
                yield x, Context(envs=torch.arange(2), global_step=step)
            elif self.stream == "rollout":
                idx = torch.arange(ROLLOUT_ROWS) + i * ROLLOUT_ROWS
                yield self.rollout[idx].clone(), Context(idx=idx, envs=torch.arange(ROLLOUT_ROWS), global_step=step)
            elif self.stream == "fwd":
                idx = torch.randperm(self.n, generator=g)[: self.rows]
                drift = 0.02 * torch.randn(self.rows, self.cols, generator=g)
                yield torch.relu(self.pre[idx] + drift), Context(idx=idx, global_step=step)
            else:
                idx = torch.randperm(self.n, generator=g)[: self.rows]
                mask = self.rollout[idx] != 0
                grad = torch.randn(self.rows, self.cols, generator=g) * 1e-3
                yield grad, Context(idx=idx, mask=mask, global_step=step)


@pytest.mark.parametrize("spec,stream", ALL_SPECS, ids=[f"{s}@{t}" for s, t in ALL_SPECS])
def test_roundtrip_recon_is_decode(spec, stream):
    """decode(encode(x)) is exactly the sender's recon, for consecutive stateful calls.

    Every codec on every stream at the real minibatch size; the variants on smaller tensors.
    """
    sc = Scenario(spec, stream) if (spec, stream) in BASE_SPECS else Scenario(spec, stream, rows=32, cols=1024)
    for x, ctx in sc.steps(3):
        enc, out = send(sc.sender, sc.receiver, x, ctx)
        recon = x if enc.recon is None else enc.recon
        assert out.shape == x.shape and out.dtype == x.dtype
        assert same_bits(out, recon), f"{spec}: receiver's decode differs from the sender's recon"
        # the parts are real tensors with the names the codec documents
        assert all(isinstance(t, torch.Tensor) for t in enc.tensors.values())


def _check_fidelity(spec: str, x: torch.Tensor, out: torch.Tensor, base: torch.Tensor | None = None) -> None:
    name = spec.partition("+")[0]
    err = (out.double() - x.double()).abs()
    ax = x.double().abs()
    if name in ("fp32", "relu", "relu:values=fp32", "frames"):
        assert torch.equal(out, x), f"{spec} must be lossless"
    elif name in ("bf16", "relu:values=bf16"):
        assert bool((err <= BF16_REL * ax).all()), f"{spec}: max rel err {(err / ax.clamp_min(1e-30)).max()}"
        assert bool((err > 0).any()), "bf16 must actually round something"
    elif name in ("fp16", "relu:values=fp16"):
        assert bool((err <= FP16_REL * ax + FP16_SUBNORMAL_ABS).all())
    elif name in ("int8", "relu:values=int8"):
        absmax = ax.amax(dim=1, keepdim=True)
        unsigned = (x.amin(dim=1, keepdim=True) >= 0) & (name == "int8")
        # half a quantisation step: absmax/127/2 (signed), absmax/255/2 (rows without negatives)
        bound = torch.where(unsigned, absmax / 510, absmax / 254) * (1 + 1e-5)
        assert bool((err <= bound).all()), f"{spec}: error above half a step"
        assert not torch.equal(out, x)
    elif name.startswith("delta"):
        diff = (x.double() - base.double()).abs().amax(dim=1, keepdim=True)
        q = dict(kv.split("=") for kv in name.partition(":")[2].split(",") if kv).get("q", "int8")
        if q == "int8":
            bound = diff / 254 * (1 + 1e-5) + 1e-6
        elif q == "bf16":
            bound = BF16_REL * (x.double() - base.double()).abs() + 1e-6
        elif q == "fp32":
            bound = torch.full_like(diff, 1e-6)
        else:
            raise AssertionError(q)
        assert bool((err <= bound).all()), f"{spec}: max err {err.max()}"
    else:
        raise AssertionError(f"no fidelity rule for {spec}")


FIDELITY = [
    ("fp32", "fwd"), ("fp32", "bwd"), ("fp32", "rollout"), ("fp32+zstd", "fwd"), ("fp32+zstd", "bwd"),
    ("relu", "fwd"), ("relu:values=fp32", "rollout"), ("relu+zstd", "fwd"), ("frames", "rollout"),
    ("frames+zstd", "rollout"), ("bf16", "fwd"), ("bf16", "bwd"), ("bf16+zstd", "bwd"), ("fp16", "fwd"),
    ("fp16", "bwd"), ("int8", "fwd"), ("int8", "bwd"), ("int8+zstd", "rollout"), ("relu:values=bf16", "fwd"),
    ("relu:values=fp16", "fwd"), ("relu:values=int8", "fwd"), ("delta", "fwd"), ("delta:q=bf16", "fwd"),
    ("delta:q=fp32", "fwd"), ("delta+zstd", "fwd"),
]


@pytest.mark.parametrize("spec,stream", FIDELITY, ids=[f"{s}@{t}" for s, t in FIDELITY])
def test_roundtrip_fidelity(spec, stream):
    """Lossless codecs reproduce x exactly; lossy ones stay within their stated error."""
    sc = Scenario(spec, stream, seed=SEED + 7)
    for x, ctx in sc.steps(2):
        base = getattr(sc.receiver, "inner", sc.receiver).view[ctx.idx].clone() if sc.name == "delta" else None
        enc, out = send(sc.sender, sc.receiver, x, ctx)
        _check_fidelity(spec, x, out, base)


def test_uint8_pixels_pass_dense_casts_unchanged():
    """With --cut input the rollout carries uint8 pixels: the casts leave them alone."""
    x = frame_stacks(3, 4, 8, 8, SEED)
    for spec in ("fp32", "bf16", "fp16", "bf16+zstd"):
        s, r = pair(spec, "rollout")
        enc, out = send(s, r, x, Context(envs=torch.arange(3)))
        assert out.dtype == torch.uint8 and torch.equal(out, x)
        assert nbytes(enc.tensors) <= x.numel() + 64


def test_int8_signed_and_unsigned_rows():
    """Rows without negatives use all 256 levels (negative scale), other rows 255 symmetric ones."""
    x = torch.stack([torch.linspace(0, 3, 64), torch.linspace(-2, 1, 64), torch.zeros(64)])
    codes, scale = quantise8(x)
    assert scale[0] < 0 and scale[1] > 0
    assert torch.isclose(scale[0].abs(), torch.tensor(3 / 255)) and torch.isclose(scale[1], torch.tensor(2 / 127))
    assert int(codes[0].min()) == -128 and int(codes[0].max()) == 127  # 0 -> -128, 3 -> 127
    assert int(codes[1].min()) == -127
    back = dequantise8(codes, scale)
    assert torch.equal(back[2], torch.zeros(64))
    assert back[0, 0] == 0 and torch.isclose(back[0, -1], torch.tensor(3.0))


# --------------------------------------------------------------------------- 2. byte counts


def test_bytes_dense_casts():
    x = gradients(B, F, SEED)
    sizes = {}
    for spec in ("fp32", "bf16", "fp16", "int8"):
        enc = parse_codec(spec, "bwd").encode(x, Context())
        sizes[spec] = nbytes(enc.tensors)
    assert sizes["fp32"] == 4 * B * F
    assert sizes["bf16"] == sizes["fp32"] // 2 == sizes["fp16"]
    assert sizes["int8"] == B * F + 4 * B  # one byte per value plus a float32 scale per row


def test_bytes_relu_features():
    x = relu_features(B, F, SEED)
    nnz = int((x != 0).sum())
    zero_frac = 1 - nnz / x.numel()
    assert 0.45 < zero_frac < 0.55
    fp32 = nbytes(parse_codec("fp32", "fwd").encode(x, Context()).tensors)
    enc = parse_codec("relu", "fwd").encode(x, Context())
    # at ~50 % density the positions go as a bitmask: one bit per entry
    assert enc.meta["m"] == 0 and enc.meta["k"] == nnz
    assert nbytes(enc.tensors) == 4 * nnz + math.ceil(x.numel() / 8)
    assert nbytes(enc.tensors) / fp32 == pytest.approx(1 - zero_frac + 1 / 32, abs=1e-3)
    bf = parse_codec("relu:values=bf16", "fwd").encode(x, Context())
    assert nbytes(bf.tensors) == 2 * nnz + math.ceil(x.numel() / 8)
    i8 = parse_codec("relu:values=int8", "fwd").encode(x, Context())
    assert nbytes(i8.tensors) == nnz + 4 * B + math.ceil(x.numel() / 8)


def test_bytes_relu_sparse_uses_varint():
    """Very sparse features: varint gaps (about a byte per entry) instead of the bitmask."""
    x = relu_features(B, F, SEED) * (torch.rand(B, F, generator=gen(SEED + 1)) < 0.04)
    enc = parse_codec("relu", "fwd").encode(x, Context())
    nnz = int((x != 0).sum())
    assert enc.meta["m"] == 1
    # one byte per gap, plus one per gap of 128 or more (at most (n - k) / 128 of those)
    assert nnz <= enc.tensors["i"].numel() <= nnz + (x.numel() - nnz) / 128
    assert enc.tensors["i"].numel() < math.ceil(x.numel() / 8)


@pytest.mark.parametrize("density,values,vbytes", [(0.02, "bf16", 2), (0.05, "fp32", 4), (0.01, "int8", 1)])
def test_bytes_ef(density, values, vbytes):
    g = gradients(B, F, SEED)
    feat = relu_features(B, F, SEED + 1)
    mask = feat != 0
    codec = parse_codec(f"ef:density={density},values={values}", "bwd")
    enc = codec.encode(g, Context(idx=torch.arange(B), mask=mask))
    k = math.ceil(density * g.numel())
    assert enc.meta["k"] == k and enc.tensors["v"].numel() == k
    assert enc.tensors["v"].element_size() == vbytes
    n_slots = int(mask.sum())
    index = enc.tensors["i"].numel()
    # varint below 11.8 % density: at most k + (n - k) / 128 bytes, never more than the bitmask
    assert index <= min(math.ceil(n_slots / 8), k + (n_slots - k) / 128)
    scale = 4 * B if values == "int8" else 0
    assert nbytes(enc.tensors) == vbytes * k + index + scale


def test_bytes_ef_capped_at_candidates():
    g = gradients(16, 64, SEED)
    mask = relu_features(16, 64, SEED + 1) != 0
    enc = parse_codec("ef:density=0.9", "bwd").encode(g, Context(idx=torch.arange(16), mask=mask))
    assert enc.meta["k"] == int(mask.sum()) < math.ceil(0.9 * g.numel())
    enc = parse_codec("ef:density=0.9,relu=0", "bwd").encode(g, Context(idx=torch.arange(16), mask=mask))
    assert enc.meta["k"] == math.ceil(0.9 * g.numel())


@pytest.mark.parametrize("p", [0.9, 0.99])
def test_bytes_paper(p):
    g = gradients(B, F, SEED)
    enc = parse_codec(f"paper:p={p},warm=0", "bwd").encode(g, Context(global_step=0))
    k = enc.tensors["v"].numel()
    assert abs(k - (1 - p) * g.numel()) <= 2
    assert enc.tensors["i"].dtype == torch.int16 and tuple(enc.tensors["i"].shape) == (k, 2)
    assert enc.tensors["v"].dtype == torch.bfloat16
    assert nbytes(enc.tensors) == 6 * k  # 2 x int16 + bfloat16 per entry
    # before the warm start ends: the full float32 gradient
    full = parse_codec(f"paper:p={p}", "bwd").encode(g, Context(global_step=29_999))
    assert full.meta == {"full": True} and nbytes(full.tensors) == 4 * g.numel()


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


def test_codecset_pack_unpack_names():
    """Part '' rides as the tensor's own name, part p as name.p; meta in header['codec'][name]."""
    g = gradients(16, 64, SEED)
    feat = relu_features(16, 64, SEED + 1)
    idx = torch.arange(16)
    tx, rx = CodecSet(fwd="relu", bwd="fp32"), CodecSet(fwd="relu", bwd="fp32")
    tensors, header = {}, {}
    seen = tx.pack("fwd", "features", feat, Context(idx=idx), tensors, header)
    assert set(tensors) == {"features.i", "features.v"} and set(header["codec"]["features"]) == {"m", "k"}
    got = rx.unpack("fwd", "features", tensors, header, Context(idx=idx), (16, 64), torch.float32)
    assert torch.equal(got, seen) and torch.equal(got, feat)
    tensors, header = {}, {}
    rx.pack("bwd", "grad", g, Context(idx=idx), tensors, header)
    assert set(tensors) == {"grad"} and header == {}
    assert torch.equal(tx.unpack("bwd", "grad", tensors, header, Context(idx=idx), (16, 64), torch.float32), g)


def test_codecset_rollout_fills_delta_cache_on_both_sides():
    tx, rx = CodecSet(rollout="bf16", fwd="delta:q=int8"), CodecSet(rollout="bf16", fwd="delta:q=int8")
    feats = relu_features(32, 64, SEED)
    for t in range(4):
        idx = torch.arange(8) + 8 * t
        tensors, header = {}, {}
        ctx = Context(idx=idx, envs=torch.arange(8))
        tx.pack("rollout", "features", feats[idx], ctx, tensors, header)
        rx.unpack("rollout", "features", tensors, header, ctx, (8, 64), torch.float32)
    # the cache holds the rollout features as stage1 decoded them (bf16), identically on both sides
    assert torch.equal(tx["fwd"].view, rx["fwd"].view)
    assert torch.equal(rx["fwd"].view, feats.to(torch.bfloat16).float())
    # the rollout's last features (no idx) are not cached
    tensors, header = {}, {}
    tx.pack("rollout", "features", feats[:8] + 1, Context(envs=torch.arange(8)), tensors, header)
    assert torch.equal(tx["fwd"].view, rx["fwd"].view)


# --------------------------------------------------------------------------- 3. paper vs a transcription


def paper_transcription(grads, steps, p, decay, warm=30_000):
    """Section IV-C, step by step, as the brief states it."""
    G = None
    sent = []
    for grad, step in zip(grads, steps):
        if step < warm:
            sent.append(("full", grad.clone().float()))
            continue
        if G is None:
            G = torch.zeros_like(grad)
        G = decay * G + grad
        tau = torch.quantile(G.abs().flatten(), p)
        M = G.abs() >= tau
        coords = M.nonzero().to(torch.int16)
        values = G[M].to(torch.bfloat16)
        G[M] = 0
        sent.append(("sparse", coords, values))
    return sent, G


def receiver_view(item, shape):
    if item[0] == "full":
        return item[1]
    _, coords, values = item
    out = torch.zeros(shape)
    out[coords[:, 0].long(), coords[:, 1].long()] = values.float()
    return out


@pytest.mark.parametrize("p", [0.9, 0.99])
@pytest.mark.parametrize("decay", [1.0, 0.99])
@pytest.mark.parametrize("kind", ["randn", "ties"])
def test_paper_matches_transcription(p, decay, kind):
    if kind == "randn":
        grads = [torch.randn(16, 64, generator=gen(SEED + i)) * 1e-3 * (1 + i) for i in range(6)]
    else:  # few distinct magnitudes: tau lands on an entry, so '>=' (not '>') matters
        grads = [torch.randint(-3, 4, (16, 64), generator=gen(SEED + i)).float() * 1e-3 for i in range(6)]
    warm = 300
    steps = [0, 100, 200, 300, 400, 500]  # full, full, full, then accumulation switches on
    expected, G = paper_transcription(grads, steps, p, decay, warm)
    s, r = pair(f"paper:p={p},decay={decay},warm={warm}", "bwd")
    for i, (grad, step) in enumerate(zip(grads, steps)):
        ctx = Context(idx=torch.arange(16), global_step=step)
        enc, out = send(s, r, grad, ctx)
        want = receiver_view(expected[i], grad.shape)
        assert torch.equal(out, want), f"step {i}: receiver's tensor differs from the transcription"
        assert torch.equal(enc.recon, want)
        if expected[i][0] == "full":
            assert s.G is None, "G must stay untouched during the warm start"
            assert enc.meta.get("full") is True and torch.equal(out, grad)
        else:
            assert torch.equal(enc.tensors["i"], expected[i][1]) and enc.tensors["i"].dtype == torch.int16
            assert same_bits(enc.tensors["v"], expected[i][2])
    assert G is not None and torch.equal(s.G, G)
    # sanity: accumulation kept something back, and later sends include carried-over mass
    assert float(G.abs().sum()) > 0


def test_paper_default_warm_is_30000():
    s = parse_codec("paper", "bwd")
    g = gradients(16, 64, SEED)
    assert s.encode(g, Context(global_step=29_999)).meta.get("full") is True
    assert s.G is None
    assert "full" not in s.encode(g, Context(global_step=30_000)).meta
    assert s.G is not None


# --------------------------------------------------------------------------- 4. error feedback


@pytest.mark.parametrize("relu", [1, 0])
@pytest.mark.parametrize("values", ["bf16", "int8"])
def test_ef_invariant(relu, values):
    n, cols, mb, epochs = 64, 96, 16, 4
    density = 0.05
    s, r = pair(f"ef:density={density},values={values},relu={relu}", "bwd")
    g = gen(SEED + relu)
    table = torch.zeros(n, cols)  # our record of each sample's residual
    ever_residual = False
    for epoch in range(epochs):
        # per-sample gradients and (epoch-dependent) ReLU masks, each sample distinct
        grads = torch.randn(n, cols, generator=g) * 1e-3 * torch.arange(1, n + 1).float()[:, None]
        masks = relu_features(n, cols, SEED + 100 + epoch) != 0
        for idx in torch.randperm(n, generator=g).split(mb):
            ctx = Context(idx=idx, mask=masks[idx], global_step=10**6)
            before = None if s.residual is None else s.residual.clone()
            enc, out = send(s, r, grads[idx], ctx)
            assert torch.equal(out, enc.recon), "receiver must decode (with the same mask) to the recon"
            m = masks[idx] if relu else torch.ones(mb, cols, dtype=torch.bool)
            accumulated = (grads[idx] + table[idx]) * m
            assert torch.equal(out + s.residual[idx], accumulated), "sent + residual != accumulated"
            assert not bool(out[~m].any()), "an entry whose feature is zero was sent"
            # top-k among the candidates
            k = min(int(m.sum()), math.ceil(density * accumulated.numel()))
            sent = out != 0
            assert enc.meta["k"] == k and int(sent.sum()) <= k
            picked = torch.zeros_like(m)
            flat = torch.nonzero(m.reshape(-1)).squeeze(1) if relu else torch.arange(m.numel())
            pos = torch.from_numpy(decode_positions(enc.meta["m"], enc.tensors["i"].numpy(), flat.numel()))
            picked.view(-1)[flat[pos]] = True
            unpicked = m & ~picked
            if bool(unpicked.any()):
                assert float(accumulated[picked].abs().min()) >= float(accumulated[unpicked].abs().max())
            # other samples' residuals untouched
            others = torch.ones(n, dtype=torch.bool)
            others[idx] = False
            if before is not None:  # the table grows as higher sample indices appear
                rows = before.shape[0]
                assert torch.equal(s.residual[:rows][others[:rows]], before[others[:rows]])
            table[idx] = s.residual[idx]
            ever_residual |= bool(s.residual[idx].any())
    assert ever_residual
    # the receiver keeps no residual of its own
    assert r.residual is None
    # a new rollout batch drops the residual
    s.new_iteration()
    assert s.residual is None
    idx = torch.arange(mb)
    grad = gradients(mb, cols, SEED + 99)
    mask = relu_features(mb, cols, SEED + 98) != 0
    enc, out = send(s, r, grad, Context(idx=idx, mask=mask, global_step=10**6))
    m = mask if relu else torch.ones_like(mask)
    assert torch.equal(out + s.residual[idx], grad * m)


def test_ef_residual_returns_to_its_own_sample():
    """A sample's unsent gradient comes back with that sample, whatever row it lands in."""
    n, cols = 8, 32
    s, r = pair("ef:density=0.04,relu=0,values=fp32", "bwd")
    grads = torch.zeros(n, cols)
    for j in range(n):
        grads[j, j] = 1.0 + j  # sample j's big entry is in column j
        grads[j, (j + 1) % cols] = 0.01 * (j + 1)  # a small one that waits
    k = math.ceil(0.04 * n * cols)
    assert k == 11
    order1 = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    _, out1 = send(s, r, grads[order1], Context(idx=order1, global_step=1))
    order2 = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    zero = torch.zeros(n, cols)
    _, out2 = send(s, r, zero, Context(idx=order2, global_step=1))
    # epoch 1 sends the 8 big entries and 3 of the small ones; epoch 2 (no new gradient)
    # sends exactly the 5 small entries left over, each in its own sample's row
    sent1 = out1.clone()
    sent2 = torch.zeros(n, cols)
    sent2[order2] = out2
    assert torch.equal(sent1 + sent2, grads)
    assert int((sent2 != 0).sum()) == 5


def test_ef_warm_start_sends_full_gradients():
    s, r = pair("ef:warm=100", "bwd")
    g = gradients(16, 64, SEED)
    mask = relu_features(16, 64, SEED) != 0
    enc, out = send(s, r, g, Context(idx=torch.arange(16), mask=mask, global_step=99))
    assert enc.meta == {"full": True} and torch.equal(out, g)
    assert s.residual is None
    enc, out = send(s, r, g, Context(idx=torch.arange(16), mask=mask, global_step=100))
    assert "full" not in enc.meta and s.residual is not None


# --------------------------------------------------------------------------- 5. delta


@pytest.mark.parametrize("q", ["none", "int8", "topk", "bf16"])
def test_delta_views_stay_in_step(q):
    n, cols, mb, epochs = 128, 256, 32, 4
    s, r = pair(f"delta:q={q},density=0.05", "fwd")
    pre = torch.randn(n, cols, generator=gen(SEED))
    drift = 0.02 * torch.randn(n, cols, generator=gen(SEED + 1))
    rollout = torch.relu(pre)
    for t in range(0, n, 16):  # rollout steps of 16 envs
        idx = torch.arange(t, t + 16)
        s.observe(idx, rollout[idx])
        r.observe(idx, rollout[idx])
    g = gen(SEED + 2)
    for epoch in range(1, epochs + 1):
        feats = torch.relu(pre + epoch * drift)
        for idx in torch.randperm(n, generator=g).split(mb):
            before = r.view.clone()
            enc, out = send(s, r, feats[idx], Context(idx=idx))
            assert torch.equal(s.view, r.view), "sender's and receiver's views diverged"
            assert torch.equal(out, enc.recon) and torch.equal(r.view[idx], out)
            others = torch.ones(n, dtype=torch.bool)
            others[idx] = False
            assert torch.equal(r.view[others], before[others])
            if q == "none":
                assert enc.tensors == {}
                assert torch.equal(out, rollout[idx])


def test_delta_int8_errors_do_not_accumulate():
    n, cols, mb, epochs = 128, 256, 32, 8
    s, r = pair("delta:q=int8", "fwd")
    pre = torch.randn(n, cols, generator=gen(SEED))
    drift = 0.01 * torch.randn(n, cols, generator=gen(SEED + 1))
    rollout = torch.relu(pre)
    s.observe(torch.arange(n), rollout)
    r.observe(torch.arange(n), rollout)
    g = gen(SEED + 2)
    errors, plain = [], []
    for epoch in range(1, epochs + 1):
        feats = torch.relu(pre + epoch * drift)
        for idx in torch.randperm(n, generator=g).split(mb):
            send(s, r, feats[idx], Context(idx=idx))
        errors.append(float((r.view - feats).abs().max()))
        codes, scale = quantise8(feats)
        plain.append(float((dequantise8(codes, scale) - feats).abs().max()))
    # tracking beats quantising the features themselves, by far, after a few epochs
    assert max(errors[2:]) < min(plain) / 10
    # and the error stays bounded instead of growing with the drift
    assert max(errors[-3:]) <= 1.5 * max(errors[:3])
    # an accumulating scheme (summing quantised epoch-to-epoch changes) would not be as good
    drift_total = float((torch.relu(pre + epochs * drift) - rollout).abs().max())
    assert errors[-1] < drift_total / 100


def test_delta_decode_before_observe():
    """Without the cached rollout rows a message's change applies to, the delta codec refuses, on either side.
    The receiver is `delta:q=none` (the change is not sent at all: decoding reads only the cache), so a missing
    part cannot be what raises; the sender is checked with the default codec."""
    s, _ = pair("delta", "fwd")
    x = relu_features(8, 32, SEED)
    with pytest.raises(CodecError, match="no cached rollout features"):
        s.encode(x, Context(idx=torch.arange(8)))
    r = parse_codec("delta:q=none", "fwd")
    missing = "no cached rollout features"
    with pytest.raises(CodecError, match=missing):
        r.decode({}, {}, Context(idx=torch.arange(8)), (8, 32), torch.float32)
    # observed only some samples (the table is as long as the highest): still no base for the others
    r.observe(torch.arange(4), x[:4])
    r.observe(torch.tensor([7]), x[7:])
    with pytest.raises(CodecError, match=missing):
        r.decode({}, {}, Context(idx=torch.arange(8)), (8, 32), torch.float32)
    assert torch.equal(r.decode({}, {}, Context(idx=torch.arange(4)), (4, 32), torch.float32), x[:4])
    # samples beyond the table, a different width, or no sample indices at all
    r.observe(torch.arange(8), x)
    with pytest.raises(CodecError, match=missing):
        r.decode({}, {}, Context(idx=torch.arange(9)), (9, 32), torch.float32)
    with pytest.raises(CodecError, match=missing):
        r.decode({}, {}, Context(idx=torch.arange(8)), (8, 16), torch.float32)
    with pytest.raises(CodecError, match=missing):
        r.decode({}, {}, Context(idx=None), (8, 32), torch.float32)
    assert torch.equal(r.decode({}, {}, Context(idx=torch.tensor([3, 1])), (2, 32), torch.float32), x[[3, 1]])


# --------------------------------------------------------------------------- 6. frames


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


# --------------------------------------------------------------------------- 7. malformed input


def _valid(spec, stream, x, ctx, observe=None, warmup=0):
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


SMALL = (16, 64)


def _feat():
    return relu_features(*SMALL, SEED)


def _grad():
    return gradients(*SMALL, SEED)


def _mask():
    return relu_features(*SMALL, SEED + 5) != 0


def _ctx_bwd():
    return Context(idx=torch.arange(16), mask=_mask(), global_step=10**6)


def _huge_frame(claim: int = 1 << 62) -> torch.Tensor:
    """A zstd frame whose header claims ``claim`` bytes of content (single segment, 8-byte size)."""
    raw = struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", claim) + bytes([1, 0, 0])
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _garbage(n=40):
    return torch.randint(0, 256, (n,), generator=gen(SEED), dtype=torch.uint8)


def _set(d, key, value):
    d[key] = value


def _zlayout(meta, key, value):
    meta["z"][key] = value


# (id, spec, stream, x-maker, ctx-maker, observe?, corruption(parts, meta))
MALFORMED = [
    # dense casts
    ("fp32-missing", "fp32", "fwd", _feat, Context, lambda p, m: p.pop("")),
    ("fp32-dtype", "fp32", "fwd", _feat, Context, lambda p, m: _set(p, "", p[""].double())),
    ("fp32-shape", "fp32", "fwd", _feat, Context, lambda p, m: _set(p, "", p[""][:, :-1])),
    ("bf16-as-fp16", "bf16", "fwd", _feat, Context, lambda p, m: _set(p, "", p[""].half())),
    ("bf16-flat", "bf16", "bwd", _grad, Context, lambda p, m: _set(p, "", p[""].reshape(-1))),
    ("int8-missing-scale", "int8", "bwd", _grad, Context, lambda p, m: p.pop("s")),
    ("int8-missing-codes", "int8", "bwd", _grad, Context, lambda p, m: p.pop("q")),
    ("int8-codes-uint8", "int8", "bwd", _grad, Context, lambda p, m: _set(p, "q", p["q"].view(torch.uint8))),
    ("int8-scale-short", "int8", "bwd", _grad, Context, lambda p, m: _set(p, "s", p["s"][:-1])),
    ("int8-scale-f64", "int8", "bwd", _grad, Context, lambda p, m: _set(p, "s", p["s"].double())),
    ("int8-scale-nan", "int8", "bwd", _grad, Context, lambda p, m: p["s"].__setitem__(3, float("nan"))),
    ("int8-scale-inf", "int8", "fwd", _feat, Context, lambda p, m: p["s"].__setitem__(0, float("-inf"))),
    # relu (sparse values, index bytes)
    ("relu-missing-i", "relu", "fwd", _feat, Context, lambda p, m: p.pop("i")),
    ("relu-missing-v", "relu", "fwd", _feat, Context, lambda p, m: p.pop("v")),
    ("relu-i-truncated", "relu", "fwd", _feat, Context, lambda p, m: _set(p, "i", p["i"][:-1])),
    ("relu-i-int8", "relu", "fwd", _feat, Context, lambda p, m: _set(p, "i", p["i"].view(torch.int8))),
    ("relu-i-2d", "relu", "fwd", _feat, Context, lambda p, m: _set(p, "i", p["i"].reshape(2, -1))),
    ("relu-v-short", "relu", "fwd", _feat, Context, lambda p, m: _set(p, "v", p["v"][:-1])),
    ("relu-v-bf16", "relu", "fwd", _feat, Context, lambda p, m: _set(p, "v", p["v"].bfloat16())),
    ("relu-k-big", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "k", 16 * 64 + 1)),
    ("relu-k-neg", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "k", -1)),
    ("relu-k-off-by-one", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "k", m["k"] - 1)),
    ("relu-k-float", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "k", float(m["k"]))),
    ("relu-k-str", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "k", str(m["k"]))),
    ("relu-k-bool", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "k", True)),
    ("relu-k-missing", "relu", "fwd", _feat, Context, lambda p, m: m.pop("k")),
    ("relu-k-list", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "k", [1])),
    ("relu-m-pairs", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "m", 2)),
    ("relu-m-other", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "m", 1 - m["m"])),
    ("relu-m-none", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "m", None)),
    ("relu-m-bool", "relu", "fwd", _feat, Context, lambda p, m: _set(m, "m", bool(m["m"]))),
    ("relu-int8-scale-nan", "relu:values=int8", "fwd", _feat, Context,
     lambda p, m: p["s"].__setitem__(0, float("nan"))),
    ("relu-int8-v-missing", "relu:values=int8", "fwd", _feat, Context, lambda p, m: p.pop("v")),
    # varint index: a truncated last value, a too-long value
    ("relu-varint-truncated", "relu", "fwd", lambda: _feat() * (torch.arange(64) % 32 == 0), Context,
     lambda p, m: _set(p, "i", torch.cat([p["i"], torch.tensor([0x80], dtype=torch.uint8)]))),
    ("relu-varint-overlong", "relu", "fwd", lambda: _feat() * (torch.arange(64) % 32 == 0), Context,
     lambda p, m: _set(p, "i", torch.tensor([0xFF] * 10 + [0x01] + [0] * (m["k"] - 1), dtype=torch.uint8))),
    ("relu-varint-past-end", "relu", "fwd", lambda: _feat() * (torch.arange(64) % 32 == 0), Context,
     lambda p, m: p["i"].__setitem__(-1, 127)),
    # ef
    ("ef-missing-i", "ef", "bwd", _grad, _ctx_bwd, lambda p, m: p.pop("i")),
    ("ef-v-fp32", "ef", "bwd", _grad, _ctx_bwd, lambda p, m: _set(p, "v", p["v"].float())),
    ("ef-k-over-slots", "ef", "bwd", _grad, _ctx_bwd, lambda p, m: _set(m, "k", int(_mask().sum()) + 1)),
    ("ef-i-truncated", "ef", "bwd", _grad, _ctx_bwd, lambda p, m: _set(p, "i", p["i"][:-2])),
    ("ef-full-bad", "ef", "bwd", _grad, _ctx_bwd, lambda p, m: _set(m, "full", True)),
    ("ef-int8-scale-inf", "ef:values=int8", "bwd", _grad, _ctx_bwd,
     lambda p, m: p["s"].__setitem__(2, float("inf"))),
    # paper
    ("paper-missing-i", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: p.pop("i")),
    ("paper-missing-v", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: p.pop("v")),
    ("paper-row-out", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: p["i"].__setitem__((0, 0), 16)),
    ("paper-col-out", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: p["i"].__setitem__((1, 1), 64)),
    ("paper-col-neg", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: p["i"].__setitem__((2, 1), -1)),
    ("paper-row-neg", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: p["i"].__setitem__((2, 0), -32768)),
    ("paper-i-int32", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: _set(p, "i", p["i"].int())),
    ("paper-i-3cols", "paper:warm=0", "bwd", _grad, _ctx_bwd,
     lambda p, m: _set(p, "i", torch.zeros(p["i"].shape[0], 3, dtype=torch.int16))),
    ("paper-i-1d", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: _set(p, "i", p["i"].reshape(-1))),
    ("paper-too-many", "paper:warm=0", "bwd", _grad, _ctx_bwd,
     lambda p, m: (_set(p, "i", torch.zeros(16 * 64 + 1, 2, dtype=torch.int16)),
                   _set(p, "v", torch.zeros(16 * 64 + 1, dtype=torch.bfloat16)))),
    ("paper-v-count", "paper:warm=0", "bwd", _grad, _ctx_bwd, lambda p, m: _set(p, "v", p["v"][:-1])),
    ("paper-full-wrong-shape", "paper", "bwd", _grad, lambda: Context(global_step=0),
     lambda p, m: _set(p, "", p[""][:-1])),
    ("paper-full-missing", "paper", "bwd", _grad, lambda: Context(global_step=0), lambda p, m: p.pop("")),
    # delta
    ("delta-q-missing", "delta", "fwd", _feat, lambda: Context(idx=torch.arange(16)), lambda p, m: p.pop("q")),
    ("delta-s-nan", "delta", "fwd", _feat, lambda: Context(idx=torch.arange(16)),
     lambda p, m: p["s"].__setitem__(0, float("nan"))),
    ("delta-q-shape", "delta", "fwd", _feat, lambda: Context(idx=torch.arange(16)),
     lambda p, m: _set(p, "q", p["q"][:8])),
    ("delta-topk-k", "delta:q=topk", "fwd", _feat, lambda: Context(idx=torch.arange(16)),
     lambda p, m: _set(m, "k", 10**9)),
    ("delta-bf16-d-dtype", "delta:q=bf16", "fwd", _feat, lambda: Context(idx=torch.arange(16)),
     lambda p, m: _set(p, "d", p["d"].float())),
    # zstd layer
    ("zstd-garbage", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _set(p, "", _garbage())),
    ("zstd-empty", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _set(p, "", torch.zeros(0, dtype=torch.uint8))),
    ("zstd-truncated", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _set(p, "", p[""][:-5])),
    ("zstd-missing-part", "fp32+zstd", "fwd", _feat, Context, lambda p, m: p.pop("")),
    ("zstd-part-int8", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _set(p, "", p[""].view(torch.int8))),
    ("zstd-no-layout", "fp32+zstd", "fwd", _feat, Context, lambda p, m: m.pop("z")),
    ("zstd-layout-list", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _set(m, "z", [["float32", [16, 64]]])),
    ("zstd-layout-huge", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _zlayout(m, "", ["float32", [2**40]])),
    ("zstd-layout-huge-dims", "fp32+zstd", "fwd", _feat, Context,
     lambda p, m: _zlayout(m, "", ["float32", [2**31, 2**31, 2**31]])),
    ("zstd-layout-neg", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _zlayout(m, "", ["float32", [-16, -64]])),
    ("zstd-layout-dtype", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _zlayout(m, "", ["complex64", [16, 64]])),
    ("zstd-layout-wrong-size", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _zlayout(m, "", ["float32", [16, 63]])),
    ("zstd-layout-wrong-dtype", "fp32+zstd", "fwd", _feat, Context,
     lambda p, m: _zlayout(m, "", ["int32", [16, 64]])),
    ("zstd-layout-float-dim", "fp32+zstd", "fwd", _feat, Context,
     lambda p, m: _zlayout(m, "", ["float32", [16.0, 64]])),
    ("zstd-layout-short", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _zlayout(m, "", ["float32"])),
    ("zstd-layout-many", "fp32+zstd", "fwd", _feat, Context,
     lambda p, m: m["z"].update({f"x{i}": ["uint8", [1]] for i in range(9)})),
    ("zstd-layout-key-int", "fp32+zstd", "fwd", _feat, Context, lambda p, m: _set(m, "z", {0: ["float32", [16, 64]]})),
    ("zstd-inner-meta", "relu+zstd", "fwd", _feat, Context, lambda p, m: _set(m, "k", -3)),
    ("zstd-swapped-parts", "relu+zstd", "fwd", _feat, Context, lambda p, m: p.update(i=p["v"], v=p["i"])),
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
    r, parts, meta, recon = _valid(spec, stream, x, ctx, observe)
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


def test_malformed_through_codecset():
    tx, rx = CodecSet(fwd="relu"), CodecSet(fwd="relu")
    feat = _feat()
    tensors, header = {}, {}
    tx.pack("fwd", "features", feat, Context(idx=torch.arange(16)), tensors, header)
    for bad_header in ({"codec": [1]}, {"codec": {"features": 3}}, {}, {"codec": {"features": {"k": "x", "m": 0}}}):
        with pytest.raises(CodecError, match="features"):
            rx.unpack("fwd", "features", tensors, bad_header, Context(idx=torch.arange(16)), SMALL, torch.float32)
    with pytest.raises(CodecError, match="features"):
        rx.unpack("fwd", "features", {}, header, Context(idx=torch.arange(16)), SMALL, torch.float32)
    got = rx.unpack("fwd", "features", tensors, header, Context(idx=torch.arange(16)), SMALL, torch.float32)
    assert torch.equal(got, feat)


def test_ef_mask_size_mismatch_is_codec_error():
    s, r = pair("ef", "bwd")
    g = _grad()
    enc = s.encode(g, _ctx_bwd())
    with pytest.raises(CodecError):
        r.decode(dict(enc.tensors), dict(enc.meta), Context(mask=torch.ones(16, 63, dtype=torch.bool)), SMALL,
                 torch.float32)


@pytest.mark.parametrize("dtype_field", [["float32"], {"a": 1}])
def test_zstd_layout_unhashable_dtype(dtype_field):
    r, parts, meta, _ = _valid("fp32+zstd", "fwd", _feat(), Context())
    meta["z"][""] = [dtype_field, [16, 64]]
    with pytest.raises(CodecError):
        r.decode(parts, meta, Context(), SMALL, torch.float32)


@pytest.mark.parametrize("spec", ["fp32+zstd", "frames"])
def test_zstd_frame_claiming_huge_content(spec):
    if spec == "frames":
        x, ctx, key = frame_stacks(2, 4, 8, 8, SEED), Context(envs=torch.arange(2)), "z"
    else:
        x, ctx, key = _feat(), Context(), ""
    r, parts, meta, _ = _valid(spec, "rollout" if spec == "frames" else "fwd", x, ctx)
    parts[key] = _huge_frame()
    with pytest.raises(CodecError):
        r.decode(parts, meta, ctx, tuple(x.shape), x.dtype)


def test_zstd_frame_claiming_too_much_within_memory_is_rejected():
    """A valid frame of more content than the tensor can need (but little enough to allocate) is an error, named
    by its claim: without the check it would decompress whole before the size is looked at."""
    r, parts, meta, _ = _valid("fp32+zstd", "fwd", _feat(), Context())
    parts[""] = compress(torch.zeros(1 << 18), 3)  # 1 MiB of zeros, a few hundred bytes on the wire
    with pytest.raises(CodecError, match="claims 1048576 bytes"):
        r.decode(parts, meta, Context(), SMALL, torch.float32)


# --------------------------------------------------------------------------- 8. parse_codec and settings


@pytest.mark.parametrize("spec,stream,words", [
    ("gzip", "fwd", ["unknown codec", "'gzip'", "fp32", "paper"]),
    ("bf16:level=3", "fwd", ["unknown parameter", "level", "none"]),
    ("ef:densty=0.1", "bwd", ["unknown parameter", "densty", "density", "values"]),
    ("ef:density", "bwd", ["unknown parameter", "density"]),
    ("ef:density=lots", "bwd", ["density", "'lots'", "float"]),
    ("paper:warm=1.5", "bwd", ["warm", "int"]),
    ("ef:values=int4", "bwd", ["values must be one of", "fp32", "bf16", "fp16", "int8"]),
    ("ef:relu=2", "bwd", ["relu must be one of", "0", "1"]),
    ("delta:q=int4", "fwd", ["q must be one of", "none", "topk"]),
    ("relu", "bwd", ["'relu' cannot carry the bwd stream", "rollout", "fwd"]),
    ("paper", "fwd", ["cannot carry the fwd stream", "bwd"]),
    ("ef", "rollout", ["cannot carry the rollout stream"]),
    ("delta", "rollout", ["cannot carry the rollout stream"]),
    ("frames", "fwd", ["cannot carry the fwd stream", "rollout"]),
    ("fp32+gzip", "fwd", ["unknown layer", "gzip", "+zstd"]),
    ("fp32+zstd:lvl=3", "fwd", ["unknown parameter", "lvl", "level"]),
    ("fp32+zstd:level=high", "fwd", ["level", "int"]),
    ("paper:p=1.5", "bwd", ["paper", "p <= 1"]),
    ("paper:p=nan", "bwd", ["paper"]),
    ("paper:decay=-0.1", "bwd", ["decay"]),
    ("paper:warm=-1", "bwd", ["warm"]),
    ("ef:density=0", "bwd", ["density"]),
    ("ef:density=1.5", "bwd", ["density"]),
    ("delta:density=0", "fwd", ["density"]),
    ("ef:warm=-5", "bwd", ["warm"]),
])
def test_parse_codec_errors(spec, stream, words):
    with pytest.raises(ValueError) as info:
        parse_codec(spec, stream)
    msg = str(info.value)
    assert spec.split(":")[0].split("+")[0] in msg, f"the codec is not named in {msg!r}"
    for word in words:
        assert word in msg, f"{word!r} missing from {msg!r}"


@pytest.mark.parametrize("spec,stream", [("fp32+zstd:level=100", "fwd"), ("frames:level=23", "rollout")])
def test_parse_codec_rejects_bad_zstd_level(spec, stream):
    with pytest.raises(ValueError):
        parse_codec(spec, stream)


SPEC_ROUNDTRIP = [
    ("fp32", "fwd"), ("bf16", "bwd"), ("fp16", "rollout"), ("int8", "fwd"), ("relu", "fwd"),
    ("relu:values=int8", "rollout"), ("paper", "bwd"), ("paper:p=0.99,decay=0.99,warm=0", "bwd"),
    ("ef", "bwd"), ("ef:density=0.02,values=int8,relu=0,warm=100", "bwd"), ("delta", "fwd"),
    ("delta:q=topk,density=0.1", "fwd"), ("frames", "rollout"), ("frames:level=9", "rollout"),
    ("fp32+zstd", "fwd"), ("relu:values=bf16+zstd:level=7", "fwd"), ("ef:density=0.1+zstd", "bwd"),
]


@pytest.mark.parametrize("spec,stream", SPEC_ROUNDTRIP, ids=[s for s, _ in SPEC_ROUNDTRIP])
def test_spec_roundtrip(spec, stream):
    codec = parse_codec(spec, stream)
    assert codec.spec() == spec  # canonical: every spec above lists only non-default values
    again = parse_codec(codec.spec(), stream)
    assert again.spec() == codec.spec() and type(again) is type(codec)
    for c1, c2 in ((codec, again), (getattr(codec, "inner", codec), getattr(again, "inner", again))):
        for key in type(c1).params:
            assert getattr(c1, key) == getattr(c2, key)


def test_spec_is_canonical():
    assert parse_codec(" ef : density = 0.05 , values=bf16 ", "bwd").spec() == "ef"
    assert parse_codec("paper:p=0.9,decay=1,warm=30000", "bwd").spec() == "paper"
    assert parse_codec("fp32+zstd:level=3", "fwd").spec() == "fp32+zstd"
    assert parse_codec("paper:p=0.990", "bwd").spec() == "paper:p=0.99"


def test_codecset_streams():
    cs = CodecSet(rollout="relu", fwd="delta:q=topk", bwd="ef:density=0.1")
    assert cs["rollout"].spec() == "relu" and cs["fwd"].spec() == "delta:q=topk"
    assert cs["bwd"].spec() == "ef:density=0.1"
    with pytest.raises(ValueError, match="bwd"):
        CodecSet(bwd="relu")


def test_settings_frames_needs_cut_input():
    errs = TrainSettings(codecs=CodecSettings(codec_rollout="frames")).errors()
    assert any("frames" in e and "--cut input" in e for e in errs)
    errs = TrainSettings(codecs=CodecSettings(codec_rollout="frames+zstd")).errors()
    assert any("frames" in e and "--cut input" in e for e in errs)
    assert TrainSettings(cut="input", codecs=CodecSettings(codec_rollout="frames")).errors() == []
    assert TrainSettings(cut="input", codecs=CodecSettings(codec_rollout="frames+zstd:level=5")).errors() == []


def test_settings_cut_input_training_streams_fp32():
    errs = TrainSettings(cut="input", codecs=CodecSettings(codec_fwd="bf16", codec_bwd="ef")).errors()
    assert any("--codec-fwd" in e and "--cut input" in e for e in errs)
    assert any("--codec-bwd" in e and "--cut input" in e for e in errs)
    errs = TrainSettings(cut="input", codecs=CodecSettings(codec_rollout="relu")).errors()
    assert any("--codec-rollout" in e and "uint8" in e for e in errs)
    assert TrainSettings(cut="input", codecs=CodecSettings(codec_rollout="bf16+zstd")).errors() == []
    # the paper's pipeline may compress every stream
    ok = CodecSettings(codec_rollout="relu:values=bf16", codec_fwd="delta", codec_bwd="paper:p=0.99")
    assert TrainSettings(codecs=ok).errors() == []


def test_settings_report_parse_errors_per_stream():
    errs = TrainSettings(codecs=CodecSettings(codec_fwd="paper", codec_bwd="ef:density=2")).errors()
    assert any(e.startswith("--codec-fwd:") and "cannot carry" in e for e in errs)
    assert any(e.startswith("--codec-bwd:") and "density" in e for e in errs)
    with pytest.raises(ValueError, match="invalid settings"):
        TrainSettings(codecs=CodecSettings(codec_bwd="gzip")).validate()


def test_sparse_int8_uses_all_256_codes_for_non_negative_rows():
    """ReLU features have no negatives: their rows get unsigned codes, half the step of signed ones."""
    torch.manual_seed(7)
    x = torch.relu(torch.randn(16, 256))
    x[3] = -x[3]  # one row with negatives keeps signed codes
    sender, receiver = parse_codec("relu:values=int8", "fwd"), parse_codec("relu:values=int8", "fwd")
    enc = sender.encode(x, Context())
    got = receiver.decode(enc.tensors, enc.meta, Context(), tuple(x.shape), torch.float32)
    assert torch.equal(got, enc.recon)
    err = (got - x).abs().amax(dim=1)
    absmax = x.abs().amax(dim=1)
    signed = torch.zeros(16, dtype=torch.bool)
    signed[3] = True
    assert bool((err[~signed] <= absmax[~signed] / 510 * 1.001).all())
    assert bool((err[signed] <= absmax[signed] / 254 * 1.001).all())
    assert bool((err[signed] > absmax[signed] / 510).all())  # the signed row really is coarser


def test_settings_name_every_codec_for_help():
    from splitrl.settings import CODEC_NAMES

    assert tuple(CODECS) == CODEC_NAMES
