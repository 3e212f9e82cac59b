"""`python benchmarks/maxmsgsize_probe.py`: what ZMQ_MAXMSGSIZE bounds, which is why splitrl gives a peer before
its hello no byte budget of that kind (docs/benchmarks/reliability.md). Should libzmq ever bound a message or
take a raised limit on a connection it has, these fail, and the budget becomes worth building."""

import pytest

from benchmarks.maxmsgsize_probe import run_case

SCALE = 1 / 16  # parts of 1 MiB; 40 MiB in parts of 64 KiB


def test_a_part_above_the_limit_drops_the_connection_and_the_peer_comes_again():
    dropped, hello = run_case("small-limit", SCALE)["receives"]
    assert dropped["got"].startswith("nothing") and hello["got"].startswith("1 part(s)")


def test_the_limit_is_a_parts_so_many_small_parts_arrive_as_one_message_held_whole():
    held, _ = run_case("small-parts", SCALE)["receives"]
    assert held["got"] == "640 part(s), 40.0 MiB"
    assert held["peak_growth_mib"] > 30


def test_a_limit_raised_after_a_connection_is_accepted_does_not_reach_it():
    hello, frame, again = run_case("raised")["receives"]
    assert hello["got"].startswith("1 part(s)") and again["got"].startswith("1 part(s)")
    assert frame["got"].startswith("nothing")  # 1 MiB, under the raised limit: dropped all the same


def test_unknown_cases_are_refused():
    with pytest.raises(ValueError, match="unknown case"):
        run_case("huge")
