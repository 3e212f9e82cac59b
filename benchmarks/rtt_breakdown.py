"""Where a framed round trip's time goes: `ZmqTransport` ping-pong over tcp loopback, timed piece by piece.

    python benchmarks/rtt_breakdown.py [--size BYTES] [--count N]

The peer (a spawned process) receives and sends back each message as a stage would (decode, then encode);
this side times, per round trip and as medians in microseconds: ``encode``, ``send`` (the frames into
ZeroMQ), ``wait`` (until the reply's frames are here: the link and the peer's turnaround), ``decode``, and
the peer's own turnaround (``peer``: from its receive returning to its send returning). ``warm encode`` and
``warm decode`` time the same calls in a tight loop, for the ratio a ping-pong's cold wake-ups cost.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import timeit
from multiprocessing.connection import Connection

__all__ = ["breakdown"]

_TIMEOUT_S = 10.0
_WARMUP = 100
_SESSION = 1


def _peer(endpoint: str, count: int, ctrl: Connection) -> None:
    import torch

    from splitrl.transport import ZmqTransport

    torch.set_num_threads(1)
    link = ZmqTransport(endpoint, bind=False, timeout=_TIMEOUT_S)
    link.session = _SESSION  # as the handshake leaves it (the receiver learns the session's layouts)
    try:
        turnaround = []
        for _ in range(count + _WARMUP):
            msg = link.recv()
            start = time.perf_counter_ns()
            link.send(msg.kind, msg.tensors)
            turnaround.append(time.perf_counter_ns() - start)
        ctrl.send(statistics.median(turnaround[_WARMUP:]) / 1000)
        ctrl.poll(_TIMEOUT_S)  # the driver's last receive is done before this side closes
    finally:
        link.close()


def breakdown(size: int = 16384, count: int = 3000) -> dict[str, float]:
    """Median microseconds of each part of ``count`` round trips of one bfloat16 tensor of ``size`` bytes."""
    import torch

    from splitrl.transport import WireLimits, ZmqTransport
    from splitrl.transport.fastwire import FastWire

    torch.set_num_threads(1)
    spawn = multiprocessing.get_context("spawn")
    link = ZmqTransport("tcp://127.0.0.1:0", bind=True, timeout=_TIMEOUT_S)
    link.session = _SESSION
    ctrl, peer_ctrl = spawn.Pipe()
    peer = spawn.Process(target=_peer, args=(link.endpoint, count, peer_ctrl), daemon=True)
    peer.start()
    tensor = torch.randn(size // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    parts: dict[str, list[int]] = {"encode": [], "send": [], "wait": [], "decode": []}
    try:
        for _ in range(count + _WARMUP):
            t0 = time.perf_counter_ns()
            frames = link.wire.encode("data", link._send_seq, None, {"x": tensor}, sid=link.session)
            t1 = time.perf_counter_ns()
            link._send_frames(frames, _TIMEOUT_S)
            link._send_seq += 1
            t2 = time.perf_counter_ns()
            got = link._recv_frames(_TIMEOUT_S)
            t3 = time.perf_counter_ns()
            link.wire.decode(got, learn_for=_SESSION)
            t4 = time.perf_counter_ns()
            for name, a, b in zip(parts, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                parts[name].append(b - a)
        if not ctrl.poll(_TIMEOUT_S):
            raise TimeoutError("the peer sent no result")
        result = {name: statistics.median(values[_WARMUP:]) / 1000 for name, values in parts.items()}
        result["peer"] = ctrl.recv()
        ctrl.send("done")
    finally:
        peer.join(_TIMEOUT_S)
        if peer.is_alive():
            peer.kill()
            peer.join(2.0)
        link.close()
    warm = FastWire(WireLimits())  # a transport's encoder and decoder, as `link.wire` is
    frames = warm.encode("data", 0, None, {"x": tensor}, sid=_SESSION)
    readable = [memoryview(bytes(frames[0])), memoryview(bytearray(frames[1]))]
    warm.decode(readable, learn_for=_SESSION)
    for name, call in (("warm encode", lambda: warm.encode("data", 0, None, {"x": tensor}, sid=_SESSION)),
                       ("warm decode", lambda: warm.decode(readable))):
        result[name] = min(timeit.repeat(call, number=2000, repeat=5)) / 2000 * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=16384, help="tensor bytes (even)")
    parser.add_argument("--count", type=int, default=3000, help="round trips timed")
    args = parser.parse_args()
    result = breakdown(args.size, args.count)
    print("  ".join(f"{name} {value:.1f}" for name, value in result.items()) + "  (median us)")


if __name__ == "__main__":
    main()
