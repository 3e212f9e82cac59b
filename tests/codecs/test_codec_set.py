"""What splitrl/codecs/__init__.py holds: `CodecSet` (pack and unpack by stream, the delta cache filled from
the rollout), `parse_codec` (errors, canonical specs), and the codec settings checked per stream."""

from __future__ import annotations

import pytest
import torch

from splitrl.codecs import CODECS, CodecError, CodecSet, Context, parse_codec
from splitrl.settings import CodecSettings, TrainSettings

from .support import SEED, SMALL, gradients, relu_features, small_features


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


def test_malformed_through_codecset():
    tx, rx = CodecSet(fwd="relu"), CodecSet(fwd="relu")
    feat = small_features()
    tensors, header = {}, {}
    tx.pack("fwd", "features", feat, Context(idx=torch.arange(16)), tensors, header)
    for bad_header in ({"codec": [1]}, {"codec": {"features": 3}}, {}, {"codec": {"features": {"k": "x", "m": 0}}}):
        with pytest.raises(CodecError, match="features"):
            rx.unpack("fwd", "features", tensors, bad_header, Context(idx=torch.arange(16)), SMALL, torch.float32)
    with pytest.raises(CodecError, match="features"):
        rx.unpack("fwd", "features", {}, header, Context(idx=torch.arange(16)), SMALL, torch.float32)
    got = rx.unpack("fwd", "features", tensors, header, Context(idx=torch.arange(16)), SMALL, torch.float32)
    assert torch.equal(got, feat)


# --------------------------------------------------------------------------- parse_codec and settings


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
    assert any("--codec-rollout" in e and "carries the observations" in e for e in errs)
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


def test_settings_name_every_codec_for_help():
    from splitrl.settings import CODEC_NAMES

    assert tuple(CODECS) == CODEC_NAMES
