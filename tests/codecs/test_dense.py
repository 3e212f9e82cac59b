"""The dense casts and int8 (splitrl/codecs/dense.py): what they do to pixels, int8's per-row scales, and the
bytes each sends."""

from __future__ import annotations

import torch

from splitrl.codecs import Context, parse_codec
from splitrl.codecs.dense import dequantise8, quantise8

from .support import B, F, SEED, frame_stacks, gradients, nbytes, pair, send


def test_uint8_pixels_pass_dense_casts_unchanged():
    """With --cut input the rollout carries uint8 pixels (images, or a Dict as one row): the casts leave them alone."""
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


def test_bytes_dense_casts():
    x = gradients(B, F, SEED)
    sizes = {}
    for spec in ("fp32", "bf16", "fp16", "int8"):
        enc = parse_codec(spec, "bwd").encode(x, Context())
        sizes[spec] = nbytes(enc.tensors)
    assert sizes["fp32"] == 4 * B * F
    assert sizes["bf16"] == sizes["fp32"] // 2 == sizes["fp16"]
    assert sizes["int8"] == B * F + 4 * B  # one byte per value plus a float32 scale per row
