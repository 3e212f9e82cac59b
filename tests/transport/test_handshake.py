"""The handshake (splitrl/transport/handshake.py) over ZmqTransport: the hellos and the settings' hash,
mismatched settings and roles named on both sides, strangers' messages dropped and counted, a timeout
without a peer, and the canonical JSON the hash is taken of.

Every receive has a timeout of at most 5 s and every socket is closed in a fixture
or a ``finally``, so no test can hang or leak a socket into the next one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from splitrl.transport import ProtocolError, TransportTimeout, encode
from splitrl.transport.handshake import HandshakeError, answer_hello, handshake, settings_hash

from .zmq_support import T


# -- handshake ---------------------------------------------------------------------------

SETTINGS = {"obs_shape": [3, 96, 96], "feature_dim": 256, "codec": "bf16", "seed": 1, "lr": 2.5e-4}


def _both(binder, connector, binder_args, connector_args):
    """Run the two handshakes concurrently; return (result or exception) per side."""
    def run(transport, args):
        try:
            if transport is binder:
                return answer_hello(transport, *args, timeout=T)
            return handshake(transport, *args, timeout=T)
        except Exception as exc:  # returned, not raised, so both sides can be checked
            return exc

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run, binder, binder_args)
        mine = run(connector, connector_args)
        theirs = future.result(timeout=3 * T)
    return theirs, mine


def test_handshake_success(pair):
    binder, connector = pair
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", dict(SETTINGS)))
    assert b["role"] == "stage0" and c["role"] == "stage1"
    for hello in (b, c):
        assert hello["proto"] == 1 and hello["settings_hash"] == settings_hash(SETTINGS)
    assert b["settings"] == SETTINGS and "settings" not in c  # stage1 reveals its hash only
    assert binder.session == connector.session and binder.session is not None
    # the hellos were seq 0; the application's messages follow from 1
    connector.send("obs")
    assert binder.recv(timeout=T).seq == 1
    assert binder.meter.entry("hello", "recv").messages == 1


def test_handshake_mismatch_stops_both_sides_naming_the_settings(pair):
    binder, connector = pair
    other = dict(SETTINGS, codec="int8", seed=2)
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", other))
    for err in (b, c):
        assert isinstance(err, HandshakeError) and isinstance(err, ProtocolError)
        text = str(err)
        assert "codec" in text and "seed" in text and "lr" not in text and "feature_dim" not in text
    assert "codec: stage1='bf16' stage0='int8'" in str(b)
    assert "codec: stage0='int8'; seed: stage0=2; (stage1's values are in its log)" in str(c)
    assert "bf16" not in str(c)


def test_handshake_missing_setting_is_named(tcp_pair):
    binder, connector = tcp_pair
    fewer = {k: v for k, v in SETTINGS.items() if k != "seed"}
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", fewer))
    assert "seed: stage1=1 stage0='<unset>'" in str(b)
    assert "seed: stage0='<unset>'" in str(c) and "stage1=1" not in str(c)


def test_handshake_wrong_role(tcp_pair):
    binder, connector = tcp_pair
    b, c = _both(binder, connector, ("stage0", "stage1", SETTINGS), ("stage0", "stage1", SETTINGS))
    for err in (b, c):
        assert isinstance(err, HandshakeError)
        assert "expected a stage1, got 'stage0'" in str(err) and "same stage" in str(err)


def test_handshake_unexpected_role(tcp_pair):
    binder, connector = tcp_pair
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("learner", "stage1", SETTINGS))
    assert isinstance(b, HandshakeError) and "expected a stage0, got 'learner'" in str(b)
    assert isinstance(c, dict)  # the learner is happy with its peer; its next recv will fail


def test_the_initiator_rejects_a_non_hello_answer(tcp_pair):
    binder, connector = tcp_pair
    binder.send("obs")
    with pytest.raises(HandshakeError, match="expected a 'hello' message, got 'obs'"):
        handshake(connector, "stage0", "stage1", SETTINGS, timeout=T)


def test_the_responder_drops_what_comes_before_the_hello(tcp_pair):
    binder, connector = tcp_pair
    connector._send_frames(encode("obs", 0), T)  # a stranger's message, as far as the responder can tell
    b, c = _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", SETTINGS))
    assert b["role"] == "stage0" and c["role"] == "stage1"
    assert binder.strangers == 1 and binder.meter.entry("_stranger", "recv").messages == 1


def test_messages_of_another_session_are_dropped_and_counted(tcp_pair):
    binder, connector = tcp_pair
    _both(binder, connector, ("stage1", "stage0", SETTINGS), ("stage0", "stage1", SETTINGS))
    other = connector.session % (2**32 - 1) + 1
    # another session's message, one of no session, and frames that do not decode: dropped, not fatal
    for frames in (encode("obs", 1, sid=other), encode("obs", 1), [b"\xc1"]):
        connector._send_frames(frames, T)
    connector.send("obs", header={"n": 3})
    assert binder.recv(timeout=T).header == {"n": 3}
    assert binder.strangers == 3 and binder.meter.entry("_stranger", "recv").messages == 3


def test_handshake_times_out_without_a_peer(make):
    connector = make("tcp://127.0.0.1:1", bind=False)  # queues the hello, nobody answers
    with pytest.raises(TransportTimeout):
        handshake(connector, "stage0", "stage1", SETTINGS, timeout=0.1)


def test_settings_hash_is_canonical_json():
    import hashlib

    assert settings_hash({"b": 1, "a": [1.5, True, None]}) == hashlib.sha256(
        b'{"a":[1.5,true,null],"b":1}'
    ).hexdigest()
    assert settings_hash({"a": 1, "b": 2}) == settings_hash({"b": 2, "a": 1})
    assert settings_hash({"shape": (3, 96)}) == settings_hash({"shape": [3, 96]})
    # the worked example in docs/PROTOCOL.md
    example = {"shape": [3, 96, 96], "name": "café", "gamma": 0.99, "eps": 1e-05, "codec": "bf16"}
    canonical = b'{"codec":"bf16","eps":1e-05,"gamma":0.99,"name":"caf\\u00e9","shape":[3,96,96]}'
    assert settings_hash(example) == hashlib.sha256(canonical).hexdigest() == (
        "2112db70da3a6f402a9c29f75558b7a61f5c1b8ceb930cfa1df12943d697edeb"
    )
