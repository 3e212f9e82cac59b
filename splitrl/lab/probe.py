"""One end of the lab's link measurements (`splitrl.lab.link`), run inside a namespace.

    python -m splitrl.lab.probe send|recv|ping|echo ENDPOINT COUNT SIZE DEV TIMEOUT

Throughput (send/recv): the receiver binds ``ENDPOINT``; the sender connects,
sends one warm-up message (connections up, receiver ready), then ``COUNT``
messages of ``SIZE`` bytes through `ZmqTransport`, and times them until the
receiver acknowledges the last. The sender prints one JSON line: its meter's
bytes for the timed messages, the seconds, and ``DEV``'s kernel tx counters over
the same interval.

Round trip (ping/echo): after the same warm-up, ``COUNT`` messages of ``SIZE``
bytes, each sent when the echo of the last came back; ping prints the seconds of
each round trip as a JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Sequence

from ..netem.netns import sysfs_tx_counters

__all__ = ["main"]

BULK_KIND = "bulk"
ACK_KIND = "ack"
START_TIMEOUT_S = 120.0
"""The peer imports torch first; on a busy machine that takes a while."""


def main(argv: Sequence[str] | None = None) -> None:
    role, endpoint, count_s, size_s, dev, timeout_s = list(argv if argv is not None else sys.argv[1:])
    count, size, timeout = int(count_s), int(size_s), float(timeout_s)
    import torch

    from ..transport import ZmqTransport

    torch.set_num_threads(1)
    if role in ("ping", "echo"):
        _round_trips(role, endpoint, count, size, timeout)
        return
    if role == "recv":
        with ZmqTransport(endpoint, bind=True, timeout=timeout, name="bulk sender") as link:
            link.recv(timeout=START_TIMEOUT_S)
            link.send(ACK_KIND)
            for _ in range(count):
                link.recv()
            link.send(ACK_KIND)
        return  # closing lingers until the ack is out
    if role != "send":
        raise SystemExit(f"role must be send or recv, got {role!r}")
    data = torch.zeros(size, dtype=torch.uint8)  # never modified, so it may be sent zero-copy again and again
    with ZmqTransport(endpoint, bind=False, timeout=timeout, name="bulk receiver") as link:
        link.send(BULK_KIND, {"data": data}, timeout=START_TIMEOUT_S)
        link.recv(timeout=START_TIMEOUT_S)
        sent0 = link.meter.total("sent")
        tx0, packets0 = sysfs_tx_counters(dev)
        t0 = time.perf_counter()
        for _ in range(count):
            link.send(BULK_KIND, {"data": data})
        link.recv()
        seconds = time.perf_counter() - t0
        tx1, packets1 = sysfs_tx_counters(dev)
        print(json.dumps({
            "app_bytes": link.meter.total("sent") - sent0, "messages": count, "seconds": seconds,
            "wire_bytes": tx1 - tx0, "wire_packets": packets1 - packets0,
        }), flush=True)


def _round_trips(role: str, endpoint: str, count: int, size: int, timeout: float) -> None:
    import torch

    from ..transport import ZmqTransport

    if role == "echo":
        with ZmqTransport(endpoint, bind=True, timeout=timeout, name="ping") as link:
            link.recv(timeout=START_TIMEOUT_S)
            link.send(ACK_KIND)
            for _ in range(count):
                msg = link.recv()
                link.send(ACK_KIND, msg.tensors)
        return
    data = torch.zeros(size, dtype=torch.uint8)
    with ZmqTransport(endpoint, bind=False, timeout=timeout, name="echo") as link:
        link.send(BULK_KIND, timeout=START_TIMEOUT_S)
        link.recv(timeout=START_TIMEOUT_S)
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            link.send(BULK_KIND, {"data": data})
            link.recv()
            seconds.append(time.perf_counter() - start)
        print(json.dumps({"rtt_s": seconds}), flush=True)


if __name__ == "__main__":
    main()
