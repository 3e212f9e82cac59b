"""The specified wire format (splitrl/transport/wire.py): exact frames, lossless round trips, what `encode`
refuses, the limits, and malformed messages named for what was expected."""

from __future__ import annotations

import struct
import warnings

import msgpack
import pytest
import torch

from splitrl.transport.errors import ProtocolError
from splitrl.transport.wire import (DTYPES, PROTOCOL_VERSION, TENSOR_ALIGNMENT, Message, WireLimits, decode, encode,
                                    frame_nbytes)

from .wire_support import ITEMSIZE, as_bytes, bitwise_equal, sample


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


@pytest.mark.parametrize("offset", [4, 16, 36, 64])
def test_received_tensors_are_aligned_as_torch_aligns_its_own(offset):
    """A CPU matmul of the same values sums in another order at another alignment (ZeroMQ hands small frames
    over as slices of one receive buffer): the heads on received features would not give the sender's numbers."""
    x = torch.randn(2, 64)
    w = torch.randn(64, 64)
    raw = bytearray(x.numel() * 4 + 128)
    start = (-torch.frombuffer(raw, dtype=torch.uint8).data_ptr()) % 64 + offset
    raw[start: start + x.numel() * 4] = x.numpy().tobytes()
    frames = encode("x", 0, None, {"t": x})
    out = decode([frames[0], memoryview(raw)[start: start + x.numel() * 4]]).tensors["t"]
    assert out.data_ptr() % TENSOR_ALIGNMENT == 0 and torch.equal(out, x)
    assert torch.equal(out @ w, x @ w)


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
