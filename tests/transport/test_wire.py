"""The wire format: exact frames, lossless round trips, and a decoder that trusts nothing.

The fuzz tests only ever allow `ProtocolError` out of `decode`: whatever a broken
or hostile peer sends, the receiver must be able to say so and carry on.
"""

from __future__ import annotations

import struct
import warnings

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitrl.transport import fastwire, wire
from splitrl.transport.errors import ProtocolError
from splitrl.transport.fastwire import FastWire
from splitrl.transport.wire import (
    DTYPES,
    PROTOCOL_VERSION,
    Message,
    WireLimits,
    _all_finite,
    decode,
    encode,
    frame_nbytes,
)

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


def roundtrip(tensors: dict, *, copy_to_bytes: bool, kind: str = "x", seq: int = 0, header=None) -> Message:
    frames = encode(kind, seq, header, tensors)
    return decode(as_bytes(frames) if copy_to_bytes else frames)


# -- round trips ---------------------------------------------------------------

def test_dtype_table_is_the_documented_one():
    assert sorted(DTYPES) == sorted(ITEMSIZE)
    for name, dtype in DTYPES.items():
        assert torch.empty((), dtype=dtype).element_size() == ITEMSIZE[name]


@pytest.mark.parametrize("copy_to_bytes", [False, True], ids=["views", "bytes"])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 1, 3, 1), ()], ids=str)
def test_roundtrip_every_dtype(dtype_name, shape, copy_to_bytes):
    t = sample(DTYPES[dtype_name], shape)
    msg = roundtrip({"t": t}, copy_to_bytes=copy_to_bytes)
    out = msg.tensors["t"]
    assert out.dtype == t.dtype and out.shape == t.shape
    assert bitwise_equal(out, t)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 5), (2, 0, 0)], ids=str)
def test_empty_tensors_have_a_zero_length_frame(dtype_name, shape):
    t = torch.empty(shape, dtype=DTYPES[dtype_name])
    frames = encode("x", 0, None, {"e": t})
    assert len(frames) == 2 and frame_nbytes(frames[1]) == 0
    for fr in (frames, as_bytes(frames)):
        out = decode(fr).tensors["e"]
        assert out.dtype == t.dtype and out.shape == t.shape and out.numel() == 0


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_zero_dim_tensor_has_empty_shape(dtype_name):
    t = sample(DTYPES[dtype_name], ())
    frames = encode("x", 0, None, {"s": t})
    spec = msgpack.unpackb(frames[0])["t"][0]
    assert spec == ["s", dtype_name, [], 1]
    assert frame_nbytes(frames[1]) == ITEMSIZE[dtype_name]
    out = decode(as_bytes(frames)).tensors["s"]
    assert out.dim() == 0 and bitwise_equal(out, t)


def _non_contiguous():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    return {
        "transposed": base[0].T,
        "permuted": base.permute(2, 0, 1),
        "strided_slice": base[:, ::2, 1::2],
        "offset_slice": base[1:, 1:],
        "negative_step_flip": base.flip(0),
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "column": base[:, 0, :1],
        "bf16_transposed": base[0].T.to(torch.bfloat16).T.T,
        "int16_strided": torch.arange(40, dtype=torch.int16).reshape(4, 10)[:, ::3],
    }


@pytest.mark.parametrize("copy_to_bytes", [False, True], ids=["views", "bytes"])
@pytest.mark.parametrize("name", sorted(_non_contiguous()))
def test_roundtrip_non_contiguous(name, copy_to_bytes):
    t = _non_contiguous()[name]
    frames = encode("x", 0, None, {"t": t})
    # The frame is the tensor in C order, whatever its strides were.
    assert bytes(frames[1]) == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    out = decode(as_bytes(frames) if copy_to_bytes else frames).tensors["t"]
    assert out.is_contiguous() and out.shape == t.shape
    assert torch.equal(out, t)


def test_tensor_requiring_grad_is_sent_by_value():
    w = torch.randn(3, 4, requires_grad=True)
    y = w * 2  # non-leaf with grad_fn
    msg = roundtrip({"w": w, "y": y}, copy_to_bytes=True)
    assert not msg.tensors["w"].requires_grad and msg.tensors["w"].grad_fn is None
    assert torch.equal(msg.tensors["w"], w.detach())
    assert torch.equal(msg.tensors["y"], y.detach())


def test_decoding_read_only_bytes_gives_writable_tensors_without_warning():
    t = torch.arange(6, dtype=torch.int32)
    frames = as_bytes(encode("x", 0, None, {"t": t}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.frombuffer warns on read-only memory
        out = decode(frames).tensors["t"]
    out += 1  # must not touch (or fail on) the immutable frame
    assert frames[1] == t.numpy().tobytes()


def test_decoding_unaligned_frames():
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    raw = bytearray(1 + 12)
    raw[1:] = t.numpy().tobytes()
    frames = encode("x", 0, None, {"t": t})
    unaligned = memoryview(raw)[1:]
    out = decode([frames[0], unaligned]).tensors["t"]
    assert out.data_ptr() % 4 == 0
    assert torch.equal(out, t)


def test_header_roundtrip():
    header = {
        "step": 12345,
        "neg": -7,
        "big": 2**63 - 1,
        "ratio": 0.125,
        "ok": True,
        "none": None,
        "name": "café ☕",
        "blob": b"\x00\xff",
        "list": [1, "a", [2.5, None]],
        "nested": {"a": {"b": [True, False]}},
        "empty_map": {},
        "empty_list": [],
    }
    msg = roundtrip({}, copy_to_bytes=True, kind="stats", seq=41, header=header)
    assert msg.kind == "stats" and msg.seq == 41 and msg.header == header and msg.tensors == {}


def test_tuples_in_the_header_arrive_as_lists():
    msg = roundtrip({}, copy_to_bytes=True, header={"shape": (3, 96, 96)})
    assert msg.header == {"shape": [3, 96, 96]}


def test_message_fields_and_nbytes():
    tensors = {"obs": torch.zeros(2, 3), "done": torch.tensor([True, False])}
    frames = encode("obs_batch", 7, {"k": 1}, tensors)
    msg = decode(as_bytes(frames))
    assert msg.kind == "obs_batch" and msg.seq == 7 and msg.header == {"k": 1}
    assert list(msg.tensors) == ["obs", "done"]  # order is preserved
    assert msg.nbytes == sum(len(bytes(f)) for f in frames)


# -- exact frames ------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_frame_count_and_lengths(n):
    tensors = {f"t{i}": sample(torch.float16, (i + 1, 3), seed=i) for i in range(n)}
    header = {"a": 1}
    frames = encode("k", 9, header, tensors)
    assert len(frames) == 1 + n
    specs = [[name, "float16", list(t.shape), i] for i, (name, t) in enumerate(tensors.items(), start=1)]
    expected_header = msgpack.packb(
        {"v": PROTOCOL_VERSION, "k": "k", "t": specs, "s": 9, "h": header}, use_bin_type=True
    )
    assert bytes(frames[0]) == expected_header
    for i, t in enumerate(tensors.values(), start=1):
        assert frame_nbytes(frames[i]) == t.numel() * 2 == len(bytes(frames[i]))


def test_worked_example_in_protocol_md_is_exact():
    """docs/PROTOCOL.md pastes these bytes; if this fails, update the document."""
    frames = encode("act", 3, {}, {"a": torch.tensor([1.0, -2.0], dtype=torch.float32)})
    assert [bytes(f).hex() for f in frames] == [
        "85a17601a16ba3616374a1749194a161a7666c6f61743332910201a17303a16880",
        "0000803f000000c0",
    ]


def test_byte_order_little_endian_c_order():
    frames = encode("x", 0, None, {
        "i": torch.tensor([[1, 256], [-1, 2**30]], dtype=torch.int32),
        "h": torch.tensor([[1, 2], [3, 4]], dtype=torch.int16).T,  # C order of the transposed view
    })
    assert bytes(frames[1]) == struct.pack("<4i", 1, 256, -1, 2**30)
    assert bytes(frames[2]) == struct.pack("<4h", 1, 3, 2, 4)


def test_bfloat16_is_the_upper_half_of_float32():
    values = [1.0, -2.0, 0.15625, -0.0, float("inf"), 2.0**100]
    frames = encode("x", 0, None, {"b": torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)})
    expected = b"".join(struct.pack("<f", v)[2:] for v in values)  # exactly representable values
    assert bytes(frames[1]) == expected
    f16 = encode("x", 0, None, {"h": torch.tensor([1.0, -2.0], dtype=torch.float16)})
    assert bytes(f16[1]) == struct.pack("<2e", 1.0, -2.0)


def test_bool_is_one_byte_zero_or_one():
    frames = encode("x", 0, None, {"b": torch.tensor([True, False, True])})
    assert bytes(frames[1]) == b"\x01\x00\x01"


def test_special_float_values_survive_bitwise_when_the_receiver_allows_them():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40], dtype=torch.float32).to(dtype)
        out = decode([bytes(f) for f in encode("x", 0, tensors={"t": t})], WireLimits(finite=False)).tensors["t"]
        assert bitwise_equal(out, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_a_protocol_error_naming_the_tensor(dtype, bad):
    t = torch.tensor([0.0, 1e-40, bad, -0.0], dtype=torch.float32).to(dtype)
    with pytest.raises(ProtocolError, match=r"tensor 'features': expected finite values, got 1 NaN or infinite of 4"):
        decode([bytes(f) for f in encode("x", 0, tensors={"ok": torch.zeros(2, dtype=torch.int64), "features": t})])


# -- encode errors -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["", "Act", "1act", "act-1", "a" * 33, "act ", "ä", 3, None, b"act"])
def test_encode_rejects_bad_kind(kind):
    with pytest.raises(ValueError, match="kind"):
        encode(kind, 0)


def test_encode_accepts_boundary_kind_and_name():
    frames = encode("a" * 32, 0, None, {"_" + "a" * 63: torch.zeros(1), "x.y_Z9": torch.zeros(1)})
    assert decode(frames).kind == "a" * 32


@pytest.mark.parametrize("name", ["", "1a", "a b", "a-b", "a" * 65, "é", 0, None])
def test_encode_rejects_bad_tensor_name(name):
    with pytest.raises(ValueError, match="name"):
        encode("x", 0, None, {name: torch.zeros(1)})


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64, torch.complex128, torch.uint16, torch.uint32])
def test_encode_rejects_unsupported_dtype(dtype):
    with pytest.raises(ValueError, match="dtype"):
        encode("x", 0, None, {"t": torch.zeros(2, dtype=dtype)})


@pytest.mark.parametrize("value", [[1.0, 2.0], 3, None, "abc"])
def test_encode_rejects_non_tensors(value):
    with pytest.raises(ValueError, match="torch.Tensor"):
        encode("x", 0, None, {"t": value})


@pytest.mark.parametrize("seq", [-1, 2**63, True, 1.0, "0", None])
def test_encode_rejects_bad_seq(seq):
    with pytest.raises(ValueError, match="sequence"):
        encode("x", seq)


def test_encode_accepts_largest_seq():
    assert decode(encode("x", 2**63 - 1)).seq == 2**63 - 1


@pytest.mark.parametrize("header", [{1: "a"}, {b"k": 1}, {"a": object()}, {"a": 2**64}, {"a": {1, 2}}])
def test_encode_rejects_bad_header(header):
    with pytest.raises(ValueError, match="header"):
        encode("x", 0, header)


def test_encode_rejects_header_a_receiver_would_reject():
    """A nested map with int keys packs fine but every receiver rejects it
    (strict_map_key): the sender must get the ValueError, not the peer a ProtocolError."""
    with pytest.raises(ValueError, match="header"):
        encode("x", 0, {"counts": {0: 5, 1: 7}})


# -- limits --------------------------------------------------------------------

def _assert_names(exc: pytest.ExceptionInfo, *parts: str) -> None:
    text = str(exc.value)
    assert "expected" in text and "got" in text, text
    for part in parts:
        assert part in text, f"{part!r} not in {text!r}"


def test_limit_max_header_bytes():
    frames = encode("x", 0, {"pad": "y" * 100})
    size = len(bytes(frames[0]))
    decode(frames, WireLimits(max_header_bytes=size))
    with pytest.raises(ProtocolError) as exc:
        decode(frames, WireLimits(max_header_bytes=size - 1))
    _assert_names(exc, "header frame", f"at most {size - 1} bytes", f"{size} bytes")


def test_limit_max_tensors():
    frames = encode("x", 0, None, {f"t{i}": torch.zeros(1) for i in range(3)})
    decode(frames, WireLimits(max_tensors=3))
    with pytest.raises(ProtocolError) as exc:
        decode(frames, WireLimits(max_tensors=2))
    _assert_names(exc, "frame count", "at most 3", "got 4")


def test_limit_max_ndim():
    frames = encode("x", 0, None, {"t": torch.zeros(1, 1, 1)})
    decode(frames, WireLimits(max_ndim=3))
    with pytest.raises(ProtocolError) as exc:
        decode(frames, WireLimits(max_ndim=2))
    _assert_names(exc, "'t' shape", "at most 2", "[1, 1, 1]")


def test_limit_max_tensor_bytes():
    frames = encode("x", 0, None, {"t": torch.zeros(4, dtype=torch.int16)})
    decode(frames, WireLimits(max_tensor_bytes=8))
    with pytest.raises(ProtocolError) as exc:
        decode(frames, WireLimits(max_tensor_bytes=7))
    _assert_names(exc, "'t' size", "at most 7 bytes", "8 bytes")


def test_limit_max_tensor_bytes_is_checked_from_the_header_before_the_frame():
    # A header that announces a huge tensor fails on the announced size, not on the frame.
    header = msgpack.packb({"v": 1, "k": "x", "s": 0, "h": {}, "t": [["t", "int64", [2**40], 1]]})
    with pytest.raises(ProtocolError) as exc:
        decode([header, b""])
    _assert_names(exc, "'t' size", f"{2**43} bytes")


def test_limit_max_message_bytes():
    frames = encode("x", 0, None, {"a": torch.zeros(4), "b": torch.zeros(4)})
    total = sum(len(bytes(f)) for f in frames)
    decode(frames, WireLimits(max_message_bytes=total))
    with pytest.raises(ProtocolError) as exc:
        decode(frames, WireLimits(max_message_bytes=total - 1))
    _assert_names(exc, "message size", f"at most {total - 1} bytes")


def test_limit_max_message_bytes_counts_the_header_alone():
    """A message without tensors is still bounded by max_message_bytes."""
    frames = encode("x", 0, {"pad": "y" * 200})
    with pytest.raises(ProtocolError) as exc:
        decode(frames, WireLimits(max_message_bytes=100))
    _assert_names(exc, "message size", "at most 100 bytes")


def test_limit_kinds():
    limits = WireLimits(kinds={"act", "obs"})
    assert isinstance(limits.kinds, frozenset)
    assert decode(encode("act", 0), limits).kind == "act"
    for reserved in ("hello", "abort"):  # always accepted
        assert decode(encode(reserved, 0), limits).kind == reserved
    with pytest.raises(ProtocolError) as exc:
        decode(encode("grad", 0), limits)
    _assert_names(exc, "message kind", "['abort', 'act', 'hello', 'obs']", "'grad'")


@pytest.mark.parametrize("field", ["max_header_bytes", "max_tensors", "max_ndim", "max_tensor_bytes", "max_message_bytes"])
@pytest.mark.parametrize("value", [0, -1, 1.5, None])
def test_limits_validate_their_arguments(field, value):
    with pytest.raises(ValueError, match=field):
        WireLimits(**{field: value})


def test_default_limits():
    limits = WireLimits()
    assert (limits.max_header_bytes, limits.max_tensors, limits.max_ndim) == (65536, 64, 8)
    assert (limits.max_tensor_bytes, limits.max_message_bytes) == (256 * 2**20, 512 * 2**20)
    assert limits.kinds is None and limits.max_frame_bytes == 256 * 2**20


# -- malformed input: specific cases ---------------------------------------------

def _header(**override) -> bytes:
    obj = {"v": 1, "k": "x", "s": 0, "h": {}, "t": [["t", "float32", [2], 1]]}
    obj.update(override)
    return msgpack.packb(obj, use_bin_type=True)


GOOD_FRAME = struct.pack("<2f", 1.0, 2.0)


@pytest.mark.parametrize("frames, what", [
    ([], "at least the header frame"),
    ([b""], "msgpack map"),
    ([b"\xc1"], "msgpack map"),
    ([msgpack.packb([1, 2])], "msgpack map"),
    ([_header()[:-3], GOOD_FRAME], "msgpack map"),
    ([_header() + b"\x00", GOOD_FRAME], "msgpack map"),
    ([msgpack.packb({"v": 1, "k": "x", "s": 0, "h": {}})], "header keys"),
    ([msgpack.packb({"v": 1, "k": "x", "s": 0, "h": {}, "t": [], "extra": 1})], "header keys"),
    ([msgpack.packb({1: 1})], "msgpack map"),
    ([_header(v=2), GOOD_FRAME], "protocol version"),
    ([_header(v=True), GOOD_FRAME], "protocol version"),
    ([_header(v=1.0), GOOD_FRAME], "protocol version"),
    ([_header(k="Bad"), GOOD_FRAME], "message kind"),
    ([_header(k=b"x"), GOOD_FRAME], "message kind"),
    ([_header(s=-1), GOOD_FRAME], "sequence number"),
    ([_header(s=2**63), GOOD_FRAME], "sequence number"),
    ([_header(s=False), GOOD_FRAME], "sequence number"),
    ([_header(s=1.0), GOOD_FRAME], "sequence number"),
    ([_header(h=[]), GOOD_FRAME], "header dict"),
    ([_header(t={}), GOOD_FRAME], "tensor list"),
    ([_header()], "frame count"),
    ([_header(), GOOD_FRAME, b""], "frame count"),
    ([_header(t=[["t", "float32", [2]]]), GOOD_FRAME], "[name, dtype, shape, frame]"),
    ([_header(t=[("t", "float32", [2], 1, 0)]), GOOD_FRAME], "[name, dtype, shape, frame]"),
    ([_header(t=[["1t", "float32", [2], 1]]), GOOD_FRAME], "name"),
    ([_header(t=[["t", "float64", [2], 1]]), GOOD_FRAME], "dtype"),
    ([_header(t=[["t", b"float32", [2], 1]]), GOOD_FRAME], "dtype"),
    ([_header(t=[["t", "float32", [-2], 1]]), GOOD_FRAME], "shape"),
    ([_header(t=[["t", "float32", [2.0], 1]]), GOOD_FRAME], "shape"),
    ([_header(t=[["t", "float32", [True, 2], 1]]), GOOD_FRAME], "shape"),
    ([_header(t=[["t", "float32", 2, 1]]), GOOD_FRAME], "shape"),
    ([_header(t=[["t", "float32", [2], 2]]), GOOD_FRAME], "frame index"),
    ([_header(t=[["t", "float32", [2], True]]), GOOD_FRAME], "frame index"),
    ([_header(t=[["t", "float32", [3], 1]]), GOOD_FRAME], "frame length"),
    ([_header(t=[["t", "float16", [2], 1]]), GOOD_FRAME], "frame length"),
    ([_header(t=[["t", "float32", [2], 1], ["t", "float32", [2], 2]]), GOOD_FRAME, GOOD_FRAME], "unique"),
    ([_header(h={"when": msgpack.Timestamp(0)}), GOOD_FRAME], "extension"),
    ([_header(h={"x": msgpack.ExtType(5, b"")}), GOOD_FRAME], "extension"),
    ([b"\x85\xa1v\x01\xa1k\xa1\xff", GOOD_FRAME], "msgpack map"),  # invalid UTF-8 in a str
])
def test_malformed_messages_say_what_was_expected(frames, what):
    with pytest.raises(ProtocolError) as exc:
        decode(frames)
    assert what in str(exc.value)
    assert len(str(exc.value)) < 400  # the offending value is abbreviated


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**64 - 1], [0, 2**62, 8], [2**40, 2**40, 0]], ids=str)
def test_empty_tensor_with_huge_dimensions_is_a_protocol_error(shape):
    """numel is 0, so the frame-length check passes, but torch cannot build the shape."""
    header = msgpack.packb({"v": 1, "k": "x", "s": 0, "h": {}, "t": [["t", "float32", shape, 1]]})
    with pytest.raises(ProtocolError, match="shape"):
        decode([header, b""])


def test_decoded_values_never_alias_the_encoder_state():
    # frames built from bytes must not share memory with the input objects
    t = torch.arange(4, dtype=torch.int64)
    frames = as_bytes(encode("x", 0, None, {"t": t}))
    out = decode(frames).tensors["t"]
    out.zero_()
    assert decode(frames).tensors["t"].tolist() == [0, 1, 2, 3]


# -- fuzzing: only ProtocolError, ever ----------------------------------------------

def _decode_or_protocol_error(frames, limits: WireLimits = WireLimits()) -> Message | None:
    try:
        msg = decode(frames, limits)
    except ProtocolError as exc:
        assert str(exc)
        return None
    # Whatever is accepted must be self-consistent.
    specs = msgpack.unpackb(bytes(frames[0]), strict_map_key=False)["t"]
    assert len(msg.tensors) == len(specs) == len(frames) - 1
    for (name, dtype_name, shape, _), t in zip(specs, msg.tensors.values()):
        assert t.dtype == DTYPES[dtype_name] and list(t.shape) == shape
    assert msg.nbytes == sum(frame_nbytes(f) for f in frames)
    return msg


msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=10),
    st.binary(max_size=10),
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=5), st.binary(max_size=5), st.integers(-5, 5)), inner, max_size=4),
    ),
    max_leaves=12,
)
dims = st.one_of(st.integers(0, 4), st.integers(-3, 2**64 - 1), st.sampled_from([0, 2**31, 2**62, 2**63, 2**64 - 1]))
extreme_dims = st.sampled_from([0, 1, 2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1])
shapes = st.one_of(
    st.lists(st.integers(0, 4), max_size=3),
    st.lists(dims, max_size=10),
    st.lists(extreme_dims, min_size=2, max_size=4),  # empty-but-huge shapes included
    msgpack_values,
)
dtype_names = st.one_of(st.sampled_from(sorted(DTYPES)), st.sampled_from(["float64", "complex64", "", "Float32"]), msgpack_values)


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), max_size=6))
def test_fuzz_random_bytes(frames):
    _decode_or_protocol_error(frames)


@FUZZ
@given(
    header=st.fixed_dictionaries(
        {},
        optional={
            "v": st.one_of(st.just(1), msgpack_values),
            "k": st.one_of(st.sampled_from(["x", "act", "hello"]), msgpack_values),
            "s": st.one_of(st.integers(0, 10), msgpack_values),
            "h": msgpack_values,
            "t": st.one_of(
                st.lists(st.tuples(st.one_of(st.just("t"), msgpack_values), dtype_names, shapes,
                                   st.one_of(st.integers(0, 3), msgpack_values)).map(list), max_size=3),
                msgpack_values,
            ),
            "extra": msgpack_values,
        },
    ),
    tail=st.lists(st.binary(max_size=32), max_size=4),
)
def test_fuzz_random_msgpack_maps(header, tail):
    _decode_or_protocol_error([msgpack.packb(header, use_bin_type=True)] + tail)


@FUZZ
@given(dtype_name=st.one_of(st.sampled_from(sorted(DTYPES)), dtype_names),
       shape=st.one_of(st.lists(extreme_dims, min_size=1, max_size=4), shapes),
       index=st.one_of(st.just(1), st.just(1), msgpack_values),
       slack=st.sampled_from([0, 0, 0, -1, 1]), data=st.data())
def test_fuzz_tensor_specs(dtype_name, shape, index, slack, data):
    """A well-formed header around one random spec, with a frame of the announced length
    (give or take a byte) whenever that length is computable and small."""
    frame = data.draw(st.binary(max_size=16))
    if isinstance(dtype_name, str) and dtype_name in ITEMSIZE and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape):
        numel = 1
        for d in shape:
            numel *= d
        size = numel * ITEMSIZE[dtype_name] + slack
        if 0 <= size <= 4096:
            frame = bytes(size)
    header = msgpack.packb({"v": 1, "k": "x", "s": 0, "h": {}, "t": [["t", dtype_name, shape, index]]}, use_bin_type=True)
    _decode_or_protocol_error([header, frame])


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


def _rebuild_header(frames: list[bytes], data) -> list[bytes]:
    """Unpack frame 0, change one field to something plausible-but-wrong, repack."""
    obj = msgpack.unpackb(frames[0])
    field = data.draw(st.sampled_from(["v", "k", "s", "h", "t", "spec", "shape", "dtype", "index", "drop_key"]))
    if field in ("v", "k", "s", "h", "t"):
        obj[field] = data.draw(msgpack_values)
    elif field == "drop_key":
        del obj[data.draw(st.sampled_from(sorted(obj)))]
    elif obj["t"]:
        spec = obj["t"][data.draw(st.integers(0, len(obj["t"]) - 1))]
        if field == "spec":
            spec[data.draw(st.integers(0, 3))] = data.draw(msgpack_values)
        elif field == "shape":
            spec[2] = data.draw(shapes)
        elif field == "dtype":
            spec[1] = data.draw(dtype_names)
        else:
            spec[3] = data.draw(st.one_of(st.integers(-1, 5), msgpack_values))
    return [msgpack.packb(obj, use_bin_type=True)] + frames[1:]


@FUZZ
@given(message=valid_messages(), data=st.data())
def test_fuzz_mutated_valid_messages(message, data):
    kind, seq, header, tensors = message
    frames = as_bytes(encode(kind, seq, header, tensors))
    mutation = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "add", "header", "swap"]))
    i = data.draw(st.integers(0, len(frames) - 1))
    if mutation == "flip" and frames[i]:
        pos = data.draw(st.integers(0, len(frames[i]) - 1))
        b = bytearray(frames[i])
        b[pos] ^= data.draw(st.integers(1, 255))
        frames[i] = bytes(b)
    elif mutation == "truncate":
        frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif mutation == "extend":
        frames[i] = frames[i] + data.draw(st.binary(min_size=1, max_size=16))
    elif mutation == "drop":
        del frames[i]
    elif mutation == "add":
        frames.insert(data.draw(st.integers(0, len(frames))), data.draw(st.binary(max_size=16)))
    elif mutation == "swap" and len(frames) > 1:
        j = data.draw(st.integers(0, len(frames) - 1))
        frames[i], frames[j] = frames[j], frames[i]
    elif mutation == "header":
        frames = _rebuild_header(frames, data)
    _decode_or_protocol_error(frames)


@FUZZ
@given(
    message=valid_messages(),
    limits=st.builds(
        WireLimits,
        max_header_bytes=st.integers(1, 200),
        max_tensors=st.integers(1, 4),
        max_ndim=st.integers(1, 4),
        max_tensor_bytes=st.integers(1, 200),
        max_message_bytes=st.integers(1, 400),
        kinds=st.one_of(st.none(), st.sets(st.sampled_from(["x", "act", "obs"]))),
    ),
)
def test_fuzz_limits_only_raise_protocol_error(message, limits):
    kind, seq, header, tensors = message
    frames = as_bytes(encode(kind, seq, header, tensors))
    msg = _decode_or_protocol_error(frames, limits)
    if msg is not None:  # accepted => within every limit
        assert len(frames[0]) <= limits.max_header_bytes
        assert len(msg.tensors) <= limits.max_tensors
        assert all(t.dim() <= limits.max_ndim for t in msg.tensors.values())
        assert all(len(f) <= limits.max_tensor_bytes for f in frames[1:])
        if msg.tensors:
            assert msg.nbytes <= limits.max_message_bytes
        assert limits.kinds is None or msg.kind in limits.kinds | {"hello", "abort"}


def _raw_message(header: dict) -> list[bytes]:
    """A message built from the documented layout only (msgpack map v/k/s/h/t), not splitrl's encoder."""
    return [msgpack.packb({"v": 1, "k": "x", "s": 0, "h": header, "t": []})]


@pytest.mark.parametrize("depth", [17, 1000, 5000])
def test_deep_nesting_in_a_header_is_a_protocol_error(depth):
    value: object = 1
    for _ in range(depth):
        value = [value]
    try:
        frames = _raw_message({"deep": value})
    except ValueError:  # msgpack's packer refuses very deep objects itself: build the bytes by hand
        frames = [b"\x85\xa1v\x01\xa1k\xa1x\xa1s\x00\xa1t\x90\xa1h\x81\xa4deep" + b"\x91" * depth + b"\x01"]
    with pytest.raises(ProtocolError, match="nested more than 16 deep|could not decode"):
        decode(frames)


def test_sixteen_levels_are_accepted():
    value: object = 1
    for _ in range(15):
        value = [value]
    assert decode(_raw_message({"ok": value})).header["ok"] == value


def test_deep_values_in_fixed_header_fields_do_not_recurse_when_reported():
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    frames = [b"\x85\xa1v" + b"\x91" * 5000 + b"\x01\xa1k\xa1x\xa1s\x00\xa1t\x90\xa1h\x80"]
    with pytest.raises(ProtocolError):
        decode(frames)
    for field in ("v", "s", "k"):
        header = {"v": 1, "k": "x", "s": 0, "h": {}, "t": []}
        header[field] = [[[[[[[[1]]]]]]]] * 3
        with pytest.raises(ProtocolError) as info:
            decode([msgpack.packb(header)])
        assert len(str(info.value)) < 300


@pytest.mark.parametrize("dtype, big", [(torch.float32, 3e38), (torch.bfloat16, 3e38)])
def test_finite_values_whose_sum_overflows_are_accepted_and_one_inf_among_them_is_not(dtype, big):
    """The receiver checks a sum first (cheap); a sum that overflows from finite values is checked exactly."""
    t = torch.full((4096,), big, dtype=dtype)
    assert torch.isinf(t.sum(dtype=torch.float32))
    assert decode([bytes(f) for f in encode("x", 0, tensors={"t": t})]).tensors["t"].equal(t)
    t[7], t[9] = float("inf"), -float("inf")  # a sum of NaN: found all the same
    with pytest.raises(ProtocolError, match="got 2 NaN or infinite of 4096"):
        decode([bytes(f) for f in encode("x", 0, tensors={"t": t})])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_2_byte_float_pattern_is_judged_finite_exactly_as_torch_does(dtype):
    """The 2-byte floats' check reads bit patterns as integers: all 65,536 of them, alone and among finite values."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns)
    assert 0 < int(finite.sum()) < len(patterns)
    for i in range(len(patterns)):
        assert _all_finite(patterns[i : i + 1]) is bool(finite[i]), hex(int(patterns[i : i + 1].view(torch.int16)))
    crowd = torch.ones(1001, dtype=dtype)
    for bad in patterns[~finite][:: 97]:
        crowd[500] = bad
        assert not _all_finite(crowd.view(7, 11, 13))
    crowd[500] = 1.0
    assert _all_finite(crowd.view(7, 11, 13))
    for i in range(0, len(patterns), 4099):  # as decode calls it: with the frame the tensor came from
        one = patterns[i : i + 1]
        assert _all_finite(one, memoryview(one.view(torch.uint8).numpy().tobytes())) is bool(finite[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_transposed_row_and_other_odd_strides_cross_as_their_values(dtype):
    """torch calls a (5, 1) transpose of a row contiguous, with a last stride of 5: framed by its values."""
    base = torch.arange(10, dtype=torch.float32).to(dtype)
    for t in (base.view(1, 10).t(), base.view(2, 5).t(), base[::3], base.view(10, 1).expand(10, 3)):
        out = decode([bytes(f) for f in encode("x", 0, tensors={"t": t})]).tensors["t"]
        assert out.shape == t.shape and torch.equal(out, t)


def test_a_sparse_tensor_is_refused_with_a_message():
    with pytest.raises(ValueError, match="dense"):
        encode("x", 0, tensors={"t": torch.eye(3).to_sparse()})


# -- layouts checked before (`fastwire.FastWire`, a transport's own) ---------------------------------

def _writable(frames: list, views: list[bool] | None = None) -> list:
    """Frames as the transports deliver them: writable buffers (the path a known layout takes); a memoryview
    over one where ``views`` says so (ZeroMQ's), a bytearray elsewhere (plain TCP's)."""
    out = [bytearray(bytes(f)) for f in frames]
    return [memoryview(f) if views and views[i % len(views)] else f for i, f in enumerate(out)]


def _outcome(decoder, frames, *limits):
    try:
        return decoder(frames, *limits)
    except ProtocolError as exc:
        return f"ProtocolError: {exc}"


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return ((a.kind, a.header, a.seq, a.nbytes, a.sid, list(a.tensors)) == (b.kind, b.header, b.seq, b.nbytes, b.sid,
                                                                            list(b.tensors))
            and all(bitwise_equal(a.tensors[name], b.tensors[name]) for name in a.tensors))


@FUZZ
@given(message=valid_messages(), sid=st.integers(1, 2**32 - 1), views=st.lists(st.booleans(), min_size=1, max_size=5),
       data=st.data())
def test_a_layout_checked_before_accepts_and_rejects_exactly_what_the_whole_check_does(message, sid, views, data):
    kind, seq, header, tensors = message
    tensors = {**tensors, "f": sample(DTYPES[data.draw(st.sampled_from(["float32", "float16", "bfloat16"]))], (3,))}
    limits = WireLimits()
    fast = FastWire(limits)
    fast.decode(_writable(encode(kind, 0, None, tensors, sid)), learn_for=sid)  # the whole check, which learns
    frames = _writable(encode(kind, seq, header, tensors, sid), views)
    assert fast._decode_known(frames) is not None  # another sequence number and header: the known path
    frames = [bytearray(f) if type(f) is memoryview else f for f in frames]  # mutable, then viewed again
    tail = 4 + len(msgpack.packb(seq)) + len(msgpack.packb(header))  # "s" and "h", after the layout's prefix
    mutation = data.draw(st.sampled_from(["none", "flip", "flip tail", "truncate", "extend", "drop", "add",
                                          "non-finite", "read-only", "wide items"]))
    i = data.draw(st.integers(0, len(frames) - 1))
    if mutation == "flip" and frames[i]:
        frames[i][data.draw(st.integers(0, len(frames[i]) - 1))] ^= data.draw(st.integers(1, 255))
    elif mutation == "flip tail":
        frames[0][data.draw(st.integers(len(frames[0]) - tail, len(frames[0]) - 1))] ^= data.draw(st.integers(1, 255))
    elif mutation == "truncate":
        del frames[i][data.draw(st.integers(0, max(0, len(frames[i]) - 1))):]
    elif mutation == "extend":
        frames[i] += data.draw(st.binary(min_size=1, max_size=16))
    elif mutation == "drop":
        del frames[i]
    elif mutation == "add":
        frames.insert(data.draw(st.integers(0, len(frames))), bytearray(data.draw(st.binary(max_size=16))))
    elif mutation == "non-finite":
        bad = torch.tensor([float(data.draw(st.sampled_from(["nan", "inf", "-inf"])))]).to(tensors["f"].dtype)
        at = data.draw(st.integers(0, 2)) * bad.element_size()
        frames[-1][at : at + bad.element_size()] = bytes(bad.view(torch.uint8).numpy())
    frames = [memoryview(f) if views[j % len(views)] else f for j, f in enumerate(frames)]
    if mutation == "read-only":
        frames[i] = bytes(frames[i])
    elif mutation == "wide items" and frames[i] and len(frames[i]) % 2 == 0:
        frames[i] = memoryview(bytearray(frames[i])).cast("H")
    assert _same(_outcome(fast.decode, frames), _outcome(decode, frames, limits))


def _frame0(seq_bytes: bytes, header_bytes: bytes, sid: int = 5) -> bytearray:
    """Frame 0 of a one-tensor "step" as the encoder lays it out, with the given encodings of "s" and "h"."""
    return bytearray(wire._prefix("step", [["x", "bfloat16", [4], 1]], sid) + b"\xa1s" + seq_bytes + b"\xa1h"
                     + header_bytes)


@pytest.mark.parametrize("case", [
    "s above 2**63 - 1", "s negative", "s a float", "h with a bin key", "h 17 levels deep", "h with an ext type",
    "h not a map", "bytes after h", "a frame too many", "a frame short", "a frame short as a view", "a NaN",
    "over max_message_bytes", "over max_header_bytes", "over max_header_bytes as a view", "frame 0 of 2-byte items",
    "not a list of frames",
])
def test_what_a_known_layout_still_checks(case):
    # The first message: frame 0 of 38 bytes, 46 in all. Each case breaks one thing, within every other limit.
    limits = {"over max_message_bytes": WireLimits(max_message_bytes=60),
              "over max_header_bytes": WireLimits(max_header_bytes=45),
              "over max_header_bytes as a view": WireLimits(max_header_bytes=45)}.get(case, WireLimits())
    fast = FastWire(limits)
    x = sample(torch.bfloat16, (4,))
    fast.decode(_writable(encode("step", 0, None, {"x": x}, sid=5)), learn_for=5)
    ok_frames = [_frame0(b"\x07", b"\x80"), bytearray(bytes(encode("x", 0, None, {"x": x})[1]))]
    assert fast._decode_known(ok_frames) is not None
    deep = {"a": 1}
    for _ in range(17):
        deep = {"a": deep}
    frames = {
        "s above 2**63 - 1": [_frame0(b"\xcf" + (2**63).to_bytes(8, "big"), b"\x80"), ok_frames[1]],
        "s negative": [_frame0(b"\xff", b"\x80"), ok_frames[1]],
        "s a float": [_frame0(msgpack.packb(7.0), b"\x80"), ok_frames[1]],
        "h with a bin key": [_frame0(b"\x07", b"\x81\xc4\x01a\x01"), ok_frames[1]],
        "h 17 levels deep": [_frame0(b"\x07", msgpack.packb(deep)), ok_frames[1]],
        "h with an ext type": [_frame0(b"\x07", b"\x81\xa1a" + msgpack.packb(msgpack.ExtType(1, b"z"))), ok_frames[1]],
        "h not a map": [_frame0(b"\x07", b"\x07"), ok_frames[1]],
        "bytes after h": [_frame0(b"\x07", b"\x80\x80"), ok_frames[1]],
        "a frame too many": ok_frames + [bytearray(b"\x00\x00")],
        "a frame short": [ok_frames[0], ok_frames[1][:6]],
        "a frame short as a view": [memoryview(ok_frames[0]), memoryview(ok_frames[1][:6])],
        "a NaN": [ok_frames[0], bytearray(ok_frames[1][:6] + b"\xc0\x7f")],
        "over max_message_bytes": [_frame0(b"\x07", msgpack.packb({"p": "a" * 12})), ok_frames[1]],
        "over max_header_bytes": [bytes(_frame0(b"\x07", msgpack.packb({"p": "a" * 12}))), ok_frames[1]],
        "over max_header_bytes as a view": [memoryview(_frame0(b"\x07", msgpack.packb({"p": "a" * 12}))), ok_frames[1]],
        "frame 0 of 2-byte items": [memoryview(_frame0(b"\x07", msgpack.packb({"ab": 1}))).cast("H"), ok_frames[1]],
        "not a list of frames": {0: ok_frames[0], 1: ok_frames[1]},
    }[case]
    with pytest.raises(ProtocolError) as checked:
        decode(frames, limits)
    with pytest.raises(ProtocolError) as got:
        fast.decode(frames)
    assert str(got.value) == str(checked.value)


def test_a_known_layout_skips_the_whole_check_and_its_limits_stay_its_own(monkeypatch):
    tensors = {"features": sample(torch.bfloat16, (4, 8)), "index": sample(torch.int64, (4,))}
    lax, strict = FastWire(WireLimits()), FastWire(WireLimits(kinds={"other"}))
    lax.decode(_writable(encode("step", 0, {"t": 0}, tensors, sid=5)), learn_for=5)
    monkeypatch.setattr(fastwire, "decode", lambda frames, limits: pytest.fail("took the whole check"))
    msg = lax.decode(_writable(encode("step", 1, {"t": 1, "g": 2}, tensors, sid=5), [False, True, True]))
    assert msg.seq == 1 and msg.header == {"t": 1, "g": 2} and msg.sid == 5
    assert all(bitwise_equal(msg.tensors[name], tensors[name]) for name in tensors)
    monkeypatch.undo()
    with pytest.raises(ProtocolError, match="message kind"):  # learnt by another transport: not this one's
        strict.decode(_writable(encode("step", 2, {"t": 2}, tensors, sid=5)))
    assert FastWire(lax.limits)._decode_known(_writable(encode("step", 2, {"t": 2}, tensors, sid=5))) is None
    other_session = _writable(encode("step", 3, {"t": 3}, tensors, sid=6))
    assert lax._decode_known(other_session) is None  # another session id is another layout
    assert lax.decode(other_session).sid == 6


def test_only_the_session_s_layouts_are_learnt_and_a_changing_one_not_for_long():
    fast = FastWire(WireLimits())
    tensors = {"x": sample(torch.float32, (3,))}
    fast.decode(_writable(encode("step", 0, None, tensors, sid=6)), learn_for=5)  # a stranger's
    fast.decode(_writable(encode("step", 0, None, tensors)), learn_for=5)  # no session id
    fast.decode(_writable(encode("step", 0, None, tensors, sid=5)))  # not asked to learn
    assert not fast.known
    key = bytes(wire._prefix("step", [], 5)[:11])
    for n in range(1, 40):  # a compressed frame's length changes every message
        fast.decode(_writable(encode("step", n, None, {"z": sample(torch.uint8, (n,))}, sid=5)), learn_for=5)
        assert len(fast.known[key]) == (min(n, 8) if n < 32 else 0)
    assert fast.learnt[key] == 32


def test_a_header_frame_that_zmq_hands_over_decodes_as_before():
    zmq = pytest.importorskip("zmq")
    frames = encode("step", 3, {"a": 1}, {"x": sample(torch.bfloat16, (4,))}, sid=5)
    msg = FastWire(WireLimits()).decode([zmq.Frame(bytes(frames[0])), bytearray(bytes(frames[1]))], learn_for=5)
    assert msg.seq == 3 and msg.header == {"a": 1}


def test_the_encoder_s_cached_prefix_is_what_msgpack_packs():
    tensors = {"a": sample(torch.float32, (2, 3)), "b": sample(torch.bfloat16, (5,))}
    fast = FastWire(WireLimits())
    for encoder in (encode, fast.encode, fast.encode):  # the specified one; the fast one builds, then reuses
        frames = encoder("act", 300, {"t": 7}, tensors, sid=2**20)
        specs = [["a", "float32", [2, 3], 1], ["b", "bfloat16", [5], 2]]
        assert bytes(frames[0]) == msgpack.packb({"v": PROTOCOL_VERSION, "k": "act", "t": specs, "i": 2**20,
                                                  "s": 300, "h": {"t": 7}}, use_bin_type=True)


@FUZZ
@given(message=valid_messages(), sid=st.one_of(st.none(), st.integers(1, 2**32 - 1)))
def test_a_transport_s_encoder_writes_the_specified_bytes(message, sid):
    kind, seq, header, tensors = message
    fast = FastWire(WireLimits())
    for _ in range(2):  # the first packs the prefix, the second reuses it
        got = fast.encode(kind, seq, header, tensors, sid)
        assert [bytes(f) for f in got] == [bytes(f) for f in encode(kind, seq, header, tensors, sid)]
