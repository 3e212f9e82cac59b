"""The gate (splitrl/transport/gate.py) of a binding ZmqTransport: one peer at a time; a second is refused
and told why while the session goes on, and a place stays held until every connection that may hold it has
closed.

Every receive has a timeout of at most 5 s and every socket is closed in a fixture
or a ``finally``, so no test can hang or leak a socket into the next one.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import zmq

from splitrl.transport import PeerGone
from splitrl.transport.base import INVALID_KIND
from splitrl.transport.gate import BUSY, _Slot

from .zmq_support import T, endpoint_for


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_a_second_peer_is_refused_and_told_while_the_session_goes_on(make, raw_push, tmp_path, kind):
    binder = make(endpoint_for(kind, tmp_path), bind=True, name="stage0", heartbeat=5)
    first = make(binder.endpoint, bind=False, name="stage1", heartbeat=5)
    first.send("x")
    assert binder.recv(timeout=T).kind == "x"
    second = make(binder.endpoint, bind=False, name="stage1", heartbeat=5)
    with pytest.raises(PeerGone, match="refused this connection: it is serving another peer"):
        second.send("x")  # the refusal may come before its socket has anywhere to queue this: then here
        second.recv(timeout=T)
    stray = raw_push(binder.endpoint)  # a bare socket's frames never arrive
    with contextlib.suppress(zmq.Again):  # (refused before its handshake ends, it may take none at all)
        stray.send_multipart([b"\x00"])
    first.send("y", {"a": torch.ones(2)})
    binder.send("z")
    assert binder.recv(timeout=T).kind == "y" and first.recv(timeout=T).kind == "z"
    deadline = time.monotonic() + T  # both of second's sockets (and the stray one): the gate's thread counts them
    while binder.gate.refused[BUSY] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert binder.gate.refused[BUSY] >= 2
    assert binder.meter.entry(INVALID_KIND, "recv").messages == 0


def test_two_peers_reaching_for_one_place_together_leave_it_held_by_the_one_admitted(make, raw_push):
    """Both accepted before either is answered: the gate cannot tell which one a ZAP request is from, and the
    refused one's close must not count as the admitted one's (a fleet's edges racing for a place, where stage1
    once declared edge 0 gone while it trained on)."""
    binder = make("tcp://127.0.0.1:0", bind=True, name="stage0", heartbeat=5)
    sockets = [raw_push(binder.endpoint) for _ in range(2)]
    slot = binder.gate._slots[b"recv"]
    deadline = time.monotonic() + T
    while not (binder.gate.refused[BUSY] == 1 and len(slot.holders) == 1) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the refused connection's close has been read
    assert binder.gate.refused[BUSY] == 1 and len(slot.holders) == 1
    assert binder.gate.holder("recv") is not None and binder.gate.vacated_since("recv") is None
    for sock in sockets:
        sock.close(linger=0)
    deadline = time.monotonic() + T
    while binder.gate.vacated_since("recv") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert binder.gate.holder("recv") is None and binder.gate.vacated_since("recv") is not None


def test_the_gate_holds_a_place_until_every_connection_that_may_hold_it_has_closed():
    """The bookkeeping alone, in the order that fooled the newest-accepted guess: accepted 3, accepted 4, the
    request from 3 admitted, 4's refused; 4 closes (still held), 3 closes (vacated); a later peer is admitted."""
    slot = _Slot("test")
    slot.accepted(3)
    slot.accepted(4)
    assert slot.admit() and slot.generation == 1
    assert not slot.admit()  # 4's request: busy
    slot.closed(4, now=1.0)
    assert slot.held and slot.vacated_at is None
    slot.accepted(5)  # a stranger after the admission is not a holder
    slot.closed(5, now=1.5)
    assert slot.held
    slot.closed(3, now=2.0)
    assert not slot.held and slot.vacated_at == 2.0
    slot.accepted(6)
    assert slot.admit() and slot.generation == 2 and slot.vacated_at is None
    slot.closed(6, now=3.0)
    assert slot.vacated_at == 3.0
    slot.accepted(7)
    slot.closed(7, now=4.0)
    assert slot.admit() and not slot.held and slot.generation == 2  # 7 asked after it had gone: nothing held
    slot.accepted(8)  # a stranger that never greets, accepted before the next peer: it might be the holder...
    slot.accepted(9)
    assert slot.admit()
    slot.closed(9, now=5.0)
    assert slot.held  # ...until libzmq drops it at the handshake timeout
    slot.closed(8, now=6.0)
    assert not slot.held and slot.vacated_at == 6.0
