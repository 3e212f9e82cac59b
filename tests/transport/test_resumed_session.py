"""A resumed session numbers on from its checkpoint (`Transport.sequence`, `Transport.go_on_from`), the meter counts
on from the checkpoint's (`ByteMeter.restore`) and every session id takes the same bytes: a resumed run's byte
counters are the uninterrupted run's (end to end: tests/schedule/test_resume.py, which compares them)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import torch

from splitrl.transport import PeerAbort, ProtocolError
from splitrl.transport import handshake as handshake_module
from splitrl.transport.base import ByteMeter
from splitrl.transport.handshake import answer_hello, handshake, new_session
from splitrl.transport.local import LocalTransport
from splitrl.transport.wire import MAX_SESSION_ID

T = 5.0
SETTINGS = {"seed": 1}
STEP = {"features": torch.ones(2, 3)}


def _session() -> tuple[LocalTransport, LocalTransport]:
    """stage0's and stage1's ends of a fresh link, the handshake done."""
    stage0, stage1 = LocalTransport.pair("stage0", "stage1", timeout=T)
    with ThreadPoolExecutor(max_workers=1) as pool:
        answered = pool.submit(answer_hello, stage1, "stage1", "stage0", SETTINGS, timeout=T)
        handshake(stage0, "stage0", "stage1", SETTINGS, timeout=T)
        answered.result(timeout=T)
    return stage0, stage1


def _exchange(stage0: LocalTransport, stage1: LocalTransport, rounds: int) -> tuple[int, int]:
    """``rounds`` steps answered by actions; the bytes the last of each cost."""
    for t in range(rounds):
        step = stage0.send("step", STEP, {"t": t})
        assert stage1.recv(timeout=T).header == {"t": t}
        action = stage1.send("action", STEP, {"t": t})
        assert stage0.recv(timeout=T).header == {"t": t}
    return step, action


def test_a_resumed_session_numbers_on_and_its_messages_cost_what_they_did():
    straight0, straight1 = _session()
    _exchange(straight0, straight1, 300)  # past 255: the numbers take 3 bytes now, not 1
    positions = straight0.sequence(), straight1.sequence()
    assert positions[0] == {"sent": 301, "received": 301} and positions[1] == {"sent": 301, "received": 301}
    costs = _exchange(straight0, straight1, 1)
    resumed0, resumed1 = _session()
    assert _exchange(*_session(), 1) != costs  # a session that starts over numbers from 1: cheaper messages
    resumed0.go_on_from(positions[0])
    resumed1.go_on_from(positions[1])
    assert _exchange(resumed0, resumed1, 1) == costs


def test_a_side_that_numbers_on_alone_shows_as_a_gap():
    stage0, stage1 = _session()
    stage0.go_on_from({"sent": 500, "received": 1})
    stage0.send("step", STEP, {"t": 0})
    with pytest.raises(ProtocolError, match="expected 1, got 500"):
        stage1.recv(timeout=T)


def test_an_abort_is_the_peers_last_word_whatever_its_number():
    """A peer that refuses a resumed session's opening aborts before it numbers on: its reason still comes through
    (not a sequence error that hides it)."""
    stage0, stage1 = _session()
    stage1.go_on_from({"sent": 300, "received": 200})
    stage0.abort("resume: this edge has no checkpoint of iteration 4")
    with pytest.raises(PeerAbort, match="no checkpoint of iteration 4"):
        stage1.recv(timeout=T)


def test_sequence_counts_the_messages_a_side_is_about_to_send():
    stage0, _ = _session()
    assert stage0.sequence(ahead=2) == {"sent": 3, "received": 1}


@pytest.mark.parametrize("position", [{"sent": 0, "received": 1}, {"sent": 5}, {"sent": True, "received": 1},
                                      {"sent": 2**63, "received": 1}, {"sent": 1, "received": 2**62 + 1},
                                      [5, 5], None])
def test_a_bad_position_is_a_value_error(position):
    stage0, _ = _session()
    with pytest.raises(ValueError, match="sequence position"):
        stage0.go_on_from(position)


def test_a_restored_meter_counts_on_from_the_snapshot_and_returns_what_it_leaves_out():
    run, resumed = ByteMeter(), ByteMeter()
    run.add("hello", "sent", 1000, 1)
    run.add("step", "sent", 500, 2)
    checkpoint = run.snapshot()
    resumed.add("hello", "sent", 1015, 1)  # the resumed session's own hello
    aside = resumed.restore(checkpoint)
    assert aside == {"net/hello/sent_bytes": 1015, "net/hello/sent_messages": 1}
    assert resumed.snapshot() == checkpoint
    resumed.add("step", "sent", 500, 2)
    run.add("step", "sent", 500, 2)
    assert resumed.snapshot() == run.snapshot()


@pytest.mark.parametrize("drawn", ["smallest", "largest"])
def test_every_session_id_takes_five_bytes(monkeypatch, drawn):
    monkeypatch.setattr(handshake_module.secrets, "randbelow", lambda n: 0 if drawn == "smallest" else n - 1)
    sid = new_session()
    assert sid == (1 << 16 if drawn == "smallest" else MAX_SESSION_ID)
    assert len(msgpack.packb(sid)) == 5
