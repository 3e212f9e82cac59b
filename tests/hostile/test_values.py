"""Bad values and bad strings from a peer: a clear error naming what was wrong, exit 1, nothing trained on."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import OPTIONS, SETTINGS

FEATURES = 4096  # the CNN encoder's output for 96 x 96 frames (section "cut" of DESIGN.md)


def _stage1(spawn, endpoint, tmp_path):
    return spawn("stage1", "--bind", endpoint, "--run-dir", str(tmp_path / "s1"), *SETTINGS.to_argv(), *OPTIONS)


def _stage0(spawn, endpoint, tmp_path):
    return spawn("stage0", "--connect", endpoint, "--run-dir", str(tmp_path / "s0"), *SETTINGS.to_argv(), *OPTIONS)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_features_stop_stage1_naming_the_tensor(spawn, raw_peers, endpoint, tmp_path, bad):
    stage1 = _stage1(spawn, endpoint, tmp_path)
    peer = raw_peers(endpoint, bind=False)
    peer.hello("stage0", SETTINGS.shared())
    kind, _, _ = peer.recv()
    assert kind == "hello"
    features = np.zeros((1, FEATURES), dtype=np.float32)
    features[0, 7] = bad
    peer.send("step", {"t": 0}, [("features", features)])
    kind, header, _ = peer.recv()  # not acted on: stage1's answer to the step is its abort, naming the tensor
    assert kind == "abort" and "tensor 'features'" in header.get("reason", ""), (kind, header)
    code, out = stage1.finish(timeout=60)
    assert code == 1, out
    assert "tensor 'features': expected finite values, got 1 NaN or infinite" in out


def test_a_nan_action_is_a_runtime_error_not_a_usage_error(spawn, raw_peers, endpoint, tmp_path):
    peer = raw_peers(endpoint, bind=True)
    stage0 = _stage0(spawn, endpoint, tmp_path)
    kind, hello, _ = peer.recv()
    assert kind == "hello"
    peer.hello("stage1", hello["settings"])
    kind, header, tensors = peer.recv()
    assert (kind, header["t"]) == ("step", 0) and np.isfinite(tensors["features"]).all()
    peer.send("action", {"t": 0}, [("action", np.full((1, 3), np.nan, dtype=np.float32))])
    code, out = stage0.finish(timeout=60)
    assert code == 1, out  # it was 2, a click usage error ("cannot convert float NaN to integer")
    assert "tensor 'action': expected finite values" in out
    assert "Usage:" not in out


def test_an_abort_reason_cannot_forge_log_lines(spawn, raw_peers, endpoint, tmp_path):
    peer = raw_peers(endpoint, bind=True)
    stage0 = _stage0(spawn, endpoint, tmp_path)
    kind, hello, _ = peer.recv()
    peer.hello("stage1", hello["settings"])
    peer.recv()
    peer.send("abort", {"reason": "bye\n12:00:00 [stage0] iter 25/25 done, return 900.0\x1b[2K" + "x" * 5000})
    code, out = stage0.finish(timeout=60)
    assert code == 1, out
    lines = [line for line in out.splitlines() if "bye" in line]
    assert len(lines) == 1 and "bye\\n12:00:00" in lines[0] and "\\x1b[2K" in lines[0]
    assert not any(line.startswith("12:00:00 [stage0] iter 25/25") for line in out.splitlines())
    assert len(lines[0]) < 2500


def test_a_deeply_nested_header_is_a_protocol_error(spawn, raw_peers, endpoint, tmp_path):
    peer = raw_peers(endpoint, bind=True)
    stage0 = _stage0(spawn, endpoint, tmp_path)
    kind, hello, _ = peer.recv()
    peer.hello("stage1", hello["settings"])
    peer.recv()
    # {"v": 1, "k": "action", "s": 1, "i": <the session>, "t": [], "h": {"t": [[[...1000 deep...]]]}},
    # written out byte by byte (0xcd: msgpack uint16)
    assert peer.sid == 0x5E55
    deep = (b"\x86\xa1v\x01\xa1k\xa6action\xa1s\x01\xa1i\xcd\x5e\x55\xa1t\x90\xa1h\x81\xa1t"
            + b"\x91" * 1000 + b"\x00")
    peer.send_raw([deep])
    code, out = stage0.finish(timeout=60)
    assert code == 1, out
    assert "nested more than 16 deep" in out and "RecursionError" not in out
