"""Where a 16 KiB round trip's time goes between raw pyzmq and a transport that hands over tensors.

    python benchmarks/floor_rtt.py [--variants one,two,two-wrap,two-check,one-check] [--count 3000] [--rounds 3]

An echo peer in a spawned process (as the stages are) and this process exchange one bfloat16 payload
over ZeroMQ tcp on loopback; both ends do the variant's work on each receipt:

- ``one``: one frame, nothing else (the transport bench's raw-zmq);
- ``two``: a 40-byte header frame before the payload (copied below pyzmq's zero-copy threshold);
- ``two-wrap``: and the payload wrapped in a tensor (`torch.frombuffer`);
- ``two-check``: and its values checked finite (`wire._all_finite`'s two reductions over the frame);
- ``one-check``: one frame, wrapped and checked.

Each variant runs ``rounds`` times, alternating with the others (the machine is noisy); a round's figure is
the median round trip of ``count`` messages after 200 of warm-up.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import zmq

SIZE = 16384
HEADER = b"x" * 40
VARIANTS = ("one", "two", "two-wrap", "two-check", "one-check")
_WARMUP = 200
_TIMEOUT_MS = 10_000


def _on_receipt(variant: str, frames: list[Any]) -> Any:
    import torch

    from splitrl.transport import wire

    payload = frames[-1]
    if variant in ("two-wrap", "two-check", "one-check"):
        tensor = torch.frombuffer(payload.buffer, dtype=torch.bfloat16)
        if variant != "two-wrap" and not wire._all_finite(tensor, payload.buffer):
            raise RuntimeError("a non-finite value")
    return payload


def _send(sock: zmq.Socket, variant: str, payload: Any) -> None:
    if variant.startswith("one"):
        sock.send(payload, copy=False)
    else:
        sock.send(HEADER, zmq.SNDMORE)
        sock.send(payload, copy=SIZE < zmq.COPY_THRESHOLD)


def _sockets(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, _TIMEOUT_MS)
        sock.setsockopt(zmq.SNDTIMEO, _TIMEOUT_MS)
    return push, pull


def _echo(to_peer: int, from_peer: int, variant: str, count: int) -> None:
    import torch  # noqa: F401  (imported before the first message, as in a stage)

    ctx = zmq.Context()
    push, pull = _sockets(ctx)
    pull.connect(f"tcp://127.0.0.1:{to_peer}")
    push.connect(f"tcp://127.0.0.1:{from_peer}")
    for _ in range(count):
        _send(push, variant, _on_receipt(variant, pull.recv_multipart(copy=False)))
    # With LINGER 0 a close drops what is still queued: the last echo could be lost (CI saw it once).
    push.close(linger=_TIMEOUT_MS)
    pull.close()
    ctx.term()


def measure(variants: list[str], count: int = 3000, rounds: int = 3) -> dict[str, list[float]]:
    """Median round trip in microseconds of each variant, one figure a round."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    import torch  # noqa: F401

    ctx = zmq.Context()
    results: dict[str, list[float]] = {v: [] for v in variants}
    payload = bytearray(SIZE)  # zeros: finite
    for _ in range(rounds):
        for variant in variants:
            push, pull = _sockets(ctx)
            to_peer = push.bind_to_random_port("tcp://127.0.0.1")
            from_peer = pull.bind_to_random_port("tcp://127.0.0.1")
            peer = multiprocessing.get_context("spawn").Process(
                target=_echo, args=(to_peer, from_peer, variant, count + _WARMUP), daemon=True)
            peer.start()
            try:
                times = []
                for i in range(count + _WARMUP):
                    start = time.perf_counter()
                    _send(push, variant, payload)
                    try:
                        frames = pull.recv_multipart(copy=False)
                    except zmq.Again:
                        state = "still running" if peer.is_alive() else f"exited with code {peer.exitcode}"
                        raise RuntimeError(f"{variant}: no echo of message {i} within {_TIMEOUT_MS // 1000} s "
                                           f"(the echo peer {state})") from None
                    _on_receipt(variant, frames)
                    if i >= _WARMUP:
                        times.append(time.perf_counter() - start)
                results[variant].append(statistics.median(times) * 1e6)
            finally:
                peer.join(timeout=10)
                if peer.is_alive():
                    peer.kill()
                push.close()
                pull.close()
    ctx.term()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for variant, figures in measure(args.variants.split(","), args.count, args.rounds).items():
        print(f"{variant:10s} " + " ".join(f"{f:.0f}" for f in figures) + "  us (median round trip, each round)")


if __name__ == "__main__":
    main()
