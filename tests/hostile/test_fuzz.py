"""Fuzzing kept in the project: mutated frames from a real session against the decoder and a live stage1.

CI runs a few thousand cases; `splitrl bench fuzz` runs the full set (docs/benchmarks/reliability.md).
"""

from __future__ import annotations

import pytest

from splitrl.bench.fuzz import Mutator, capture_session, fuzz_decoder, fuzz_stage1
from splitrl.stages import STAGE0, STAGE1


@pytest.fixture(scope="module")
def captured():
    return capture_session()


def test_the_capture_holds_every_kind_of_a_session(captured):
    import msgpack

    kinds = {msgpack.unpackb(m[0])["k"] for sender in captured.values() for m in sender}
    assert {"hello", "step", "action", "rollout_end", "train_fwd", "train_bwd", "iter_end", "iter_stats",
            "close"} <= kinds
    assert captured[STAGE0] and captured[STAGE1]


def test_mutations_are_reproducible_and_varied(captured):
    corpus = captured[STAGE0]
    first, second = Mutator(corpus, seed=7), Mutator(corpus, seed=7)
    a = [first() for _ in range(200)]
    b = [second() for _ in range(200)]
    assert a == b
    assert {how for how, _ in a} == set(Mutator.KINDS)
    assert sum(frames not in corpus for _, frames in a) > 150  # most cases differ from every original


def test_the_decoder_only_decodes_or_raises_protocol_errors(captured):
    counts = fuzz_decoder([m for sender in captured.values() for m in sender], cases=4000, seed=1)
    assert counts.findings == []
    assert counts.outcomes["protocol_error"] > 1000 and counts.outcomes["decoded"] > 100


def test_a_live_stage1_stops_cleanly_or_goes_on(captured):
    counts = fuzz_stage1(captured, cases=12, seed=1)
    assert counts.findings == []
    assert sum(counts.outcomes.values()) == 12
    # The replay is in stage1's session: the mutated message reached the loop, which stopped on it or
    # went on. (A timeout is a message dropped as a stranger's, e.g. its session id mutated: a few at most.)
    assert counts.outcomes["timeout"] <= 4, counts.outcomes
    assert counts.outcomes["ProtocolError"] + counts.outcomes["session_completed"] >= 6, counts.outcomes
