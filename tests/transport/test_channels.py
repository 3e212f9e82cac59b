"""Several streams over one link: routing by kind, one sequence of sends, failures reach every stream."""

import threading
import time

import pytest
import torch

from splitrl.transport import PeerAbort, ProtocolError, TransportTimeout
from splitrl.transport.channels import Channels
from splitrl.transport.local import LocalTransport


@pytest.fixture
def pair():
    a, b = LocalTransport.pair("a", "b", timeout=5)
    yield a, b
    a.close()
    b.close()


def test_messages_reach_the_channel_their_kind_belongs_to_in_order(pair):
    ours, theirs = pair
    channels = Channels(ours, {"action": "rollout", "train_bwd": "train"})
    try:
        for i in range(3):
            theirs.send("train_bwd", {"grad": torch.full((2,), float(i))}, {"i": i})
            theirs.send("action", header={"i": i})
        assert [channels["rollout"].recv().header["i"] for _ in range(3)] == [0, 1, 2]
        got = [channels["train"].recv() for _ in range(3)]
        assert [m.header["i"] for m in got] == [0, 1, 2] and float(got[2].tensors["grad"][0]) == 2.0
        with pytest.raises(TransportTimeout, match="rollout"):
            channels["rollout"].recv(timeout=0.2)
    finally:
        channels.close()


def test_two_threads_send_through_one_sequence(pair):
    ours, theirs = pair
    channels = Channels(ours, {"x": "one"})
    try:
        def send(channel, kind):
            for i in range(200):
                channel.send(kind, {"t": torch.zeros(8)}, {"i": i})

        threads = [threading.Thread(target=send, args=(channels[name], kind)) for name, kind in
                   (("one", "step"), ("one", "train_fwd"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        kinds = [theirs.recv().kind for _ in range(400)]  # any gap or reorder in seq would raise here
        assert kinds.count("step") == kinds.count("train_fwd") == 200
        assert ours.meter.entry("step", "sent").messages == 200
    finally:
        channels.close()


@pytest.mark.parametrize("trouble", ["abort", "unrouted", "failed thread"])
def test_a_failure_reaches_every_channel(pair, trouble):
    ours, theirs = pair
    channels = Channels(ours, {"action": "rollout", "train_bwd": "train"})
    try:
        if trouble == "abort":
            theirs.abort("peer going away")
            expected = PeerAbort
        elif trouble == "unrouted":
            theirs.send("iter_stats")
            expected = ProtocolError
        else:
            channels.fail(RuntimeError("the rollout thread broke"))
            expected = RuntimeError
        start = time.monotonic()
        for name in ("rollout", "train", "rollout"):  # and again: it stays failed
            with pytest.raises(expected):
                channels[name].recv(timeout=5)
        assert time.monotonic() - start < 4
    finally:
        channels.close()
