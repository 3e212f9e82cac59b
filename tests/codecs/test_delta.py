"""The delta codec (splitrl/codecs/delta.py): sender's and receiver's views of the rollout features stay in
step, int8 errors do not accumulate, and nothing decodes without the cached rollout rows."""

from __future__ import annotations

import pytest
import torch

from splitrl.codecs import CodecError, Context, parse_codec
from splitrl.codecs.dense import dequantise8, quantise8

from .support import SEED, gen, pair, relu_features, send


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
