"""The fast path (splitrl/transport/fastwire.py): a layout a transport checked before accepts and rejects
exactly what the specified decoder does, error for error, still checks what can change, and its encoder
writes the specified bytes."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from splitrl.transport import fastwire, wire
from splitrl.transport.errors import ProtocolError
from splitrl.transport.fastwire import FastWire
from splitrl.transport.wire import DTYPES, PROTOCOL_VERSION, WireLimits, decode, encode

from .wire_support import FUZZ, bitwise_equal, sample, valid_messages


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
