"""Every codec on every stream it can carry: two instances (sender and receiver, as in two processes) agree
bit for bit, for consecutive stateful calls, and stay within their stated error."""

from __future__ import annotations

import functools

import pytest
import torch

from splitrl.codecs import CODECS, Context, fits

from .support import B, F, SEED, frame_stacks, gen, pair, same_bits, send

BF16_REL = 2.0**-8  # round to nearest with an 8-bit significand
FP16_REL = 2.0**-11  # 11-bit significand (normal numbers)
FP16_SUBNORMAL_ABS = 2.0**-25  # half the spacing of float16 subnormals


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
        # ... and the names, dtypes and shapes its layout says a receiver may check before decoding
        layout = sc.receiver.layout(tuple(x.shape), x.dtype, enc.meta)
        assert set(layout) == set(enc.tensors), f"{spec}: layout {sorted(layout)}, parts {sorted(enc.tensors)}"
        for key, t in enc.tensors.items():
            dtype, dims = layout[key]
            assert t.dtype == dtype and fits(t.shape, dims), f"{spec}: part {key!r}: {t.dtype} {list(t.shape)}, " \
                f"layout {dtype} {dims}"


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
