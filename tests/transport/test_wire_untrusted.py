"""The specified decoder trusts nothing: whatever a broken or hostile peer sends, only `ProtocolError` ever
comes out of `decode`, so the receiver can say so and carry on. Fuzzed bytes, maps and tensor specs,
mutated valid messages, headers nested too deep, and non-finite values a sum would hide."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from splitrl.transport.errors import ProtocolError
from splitrl.transport.wire import DTYPES, Message, WireLimits, _all_finite, decode, encode, frame_nbytes

from .wire_support import FUZZ, ITEMSIZE, as_bytes, valid_messages


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
