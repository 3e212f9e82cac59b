"""What a hostile peer can make a receiver hold, measured as the victim process's RSS and peak.

`splitrl.bench.reliability` runs the victim (a binding transport with the stages' limits) in a process
of its own; its hostile sides use only pyzmq or sockets, msgpack and the layout of docs/PROTOCOL.md.
(The plain TCP transport's bound, a frame's buffer growing only with its bytes, is
tests/transport/test_tcp.py::test_an_announced_frame_costs_memory_only_as_its_bytes_arrive.)
"""

from __future__ import annotations

from splitrl.bench.reliability import zmq_many_parts, zmq_oversized_frame, zmq_refused_connections


def test_a_frame_above_the_limit_is_refused_before_it_is_held():
    r = zmq_oversized_frame()
    assert r["outcome"].startswith(("TransportTimeout", "PeerGone")), r  # libzmq dropped it unread
    assert "expected 0, got 1" in r["next_message"], r  # the link goes on; the loss shows as a gap
    assert r["peak_growth_mib"] < 64, r  # a 257 MiB frame never allocated


def test_connections_beyond_the_first_cannot_fill_the_receivers_memory():
    r = zmq_refused_connections(intruders=32, messages=8)
    assert r["outcome"] == "step", r  # the holder's message, as if nobody else had tried
    assert r["peak_growth_mib"] < 64, r  # it was +547 MiB with 32 connections


def test_a_message_of_too_many_parts_is_dropped_and_not_kept():
    """libzmq holds a multipart message whole before the receiver sees it (docs/PROTOCOL.md section 5):
    the receiver drops it part by part, and what libzmq held is given back."""
    r = zmq_many_parts(100)
    assert "expected at most 65 frames" in r["outcome"], r
    assert r["next_message"] == "step", r
    assert r["rss_growth_mib"] < 48, r

