"""The sparse codecs (splitrl/codecs/sparse.py): the bytes relu, ef and paper send, paper against a
transcription of the paper's section IV-C, error feedback's invariant, and relu's int8 codes."""

from __future__ import annotations

import math

import pytest
import torch

from splitrl.codecs import CodecError, Context, parse_codec
from splitrl.codecs.indexcoding import decode_positions

from .support import (
    B,
    F,
    SEED,
    SMALL,
    bwd_context,
    gen,
    gradients,
    nbytes,
    pair,
    relu_features,
    same_bits,
    send,
    small_gradients,
)

# --------------------------------------------------------------------------- byte counts


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


# --------------------------------------------------------------------------- paper vs a transcription


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


# --------------------------------------------------------------------------- error feedback


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


def test_ef_mask_size_mismatch_is_codec_error():
    s, r = pair("ef", "bwd")
    g = small_gradients()
    enc = s.encode(g, bwd_context())
    with pytest.raises(CodecError):
        r.decode(dict(enc.tensors), dict(enc.meta), Context(mask=torch.ones(16, 63, dtype=torch.bool)), SMALL,
                 torch.float32)


# --------------------------------------------------------------------------- int8 values


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
