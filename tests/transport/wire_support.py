"""What the wire tests share: the fuzzing settings, values across a dtype's whole range, frames as a socket
delivers them, bitwise equality, and a strategy for valid messages."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from splitrl.transport.wire import DTYPES

__all__ = ["FUZZ", "ITEMSIZE", "sample", "as_bytes", "bitwise_equal", "valid_messages"]


FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,  # no .hypothesis directory in the repository
    derandomize=True,  # the same examples on every run: a failure is never a fluke
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
            "int16": 2, "int32": 4, "int64": 8, "bool": 1}


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values that exercise the whole range of a dtype (signs, large magnitudes)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def as_bytes(frames: list) -> list[bytes]:
    """Frames as a socket delivers them: immutable bytes."""
    return [bytes(f) for f in frames]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@st.composite
def valid_messages(draw):
    n = draw(st.integers(0, 3))
    tensors = {}
    for i in range(n):
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        tensors[f"t{i}"] = sample(dtype, shape, seed=i)
    header = draw(st.dictionaries(st.text(max_size=4), st.one_of(st.integers(-5, 5), st.text(max_size=4)), max_size=3))
    kind = draw(st.sampled_from(["x", "act", "hello", "abort"]))
    seq = draw(st.integers(0, 2**63 - 1))
    return kind, seq, header, tensors
