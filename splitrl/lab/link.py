"""The lab's link, measured before the stages run: a bulk transfer's throughput and a message's round trip.

Both run the project's own `ZmqTransport` between the two namespaces: `splitrl.lab.probe`
at both ends, the receiver in stage1's namespace. Throughput is application bytes per
second (goodput) until the receiver acknowledges the last message, beside the wire
rate from the sender's veth counters over the same interval. At 20 Mbit/s goodput is
at most 20 x 1448 / 1514 = 19.1 Mbit/s: tc's rate counts the Ethernet and IP/TCP
headers too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from ..netem.netns import STAGE1_ADDR, Lab
from ..netem.tc import format_rate, format_size

__all__ = ["BULK_PORT", "PING_PORT", "Throughput", "measure_throughput", "measure_round_trip"]

BULK_PORT = 5557
"""The throughput probe's port pair (beside the stages' `splitrl.lab.stages.DEFAULT_PORT`)."""
PING_PORT = 5559
"""The round-trip probe's port pair, through the delay relay when there is one (as the stages' link is)."""
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Throughput:
    """One bulk transfer stage0 -> stage1 through `ZmqTransport`."""

    app_bytes: int
    """What the sender's meter counted for the timed messages (frame payloads)."""
    messages: int
    seconds: float
    wire_bytes: int
    """The sender's veth tx_bytes over the same interval (headers included)."""
    wire_packets: int

    @property
    def goodput_bits(self) -> float:
        return self.app_bytes * 8 / self.seconds

    @property
    def wire_bits(self) -> float:
        return self.wire_bytes * 8 / self.seconds

    def text(self) -> str:
        return (
            f"{format_rate(self.goodput_bits)} of application bytes ({format_size(self.app_bytes)} in "
            f"{self.messages} messages, {self.seconds:.2f} s), {format_rate(self.wire_bits)} on the wire "
            f"({self.wire_packets} packets, kernel tx counter)"
        )


def _probe(lab: Lab, roles: tuple[str, str], port: int, count: int, size: int, timeout: float,
           deadline: float, what: str, connect_host: str = STAGE1_ADDR) -> dict[str, Any]:
    """Run the probe's two ends (stage1's namespace binds ``port``, then stage0's connects to it at
    ``connect_host``); the stage0 end's JSON line."""
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}

    def peer(side: str, role: str, host: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "splitrl.lab.probe", role, f"tcp://{host}:{port}", str(count),
                str(size), lab.dev(side), str(timeout)]
        return lab.spawn(side, argv, **pipe)

    receiver = peer("stage1", roles[1], STAGE1_ADDR)
    sender = peer("stage0", roles[0], connect_host)
    try:
        out, err = sender.communicate(timeout=deadline)
        if sender.returncode != 0 or not out.strip():
            lab.stop_processes(grace=2)
            _, receiver_err = receiver.communicate(timeout=10)
            raise RuntimeError(
                f"the {what} measurement failed (exit {sender.returncode}):\n{err.strip()[-2000:]}"
                + (f"\nother end: {receiver_err.strip()[-1000:]}" if receiver_err.strip() else "")
            )
        receiver.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        lab.stop_processes(grace=2)
        raise RuntimeError(f"the {what} measurement did not finish within {deadline:.0f} s") from None
    return json.loads(out.strip().splitlines()[-1])


def measure_throughput(
    lab: Lab, total_bytes: int = 8 * _MIB, message_bytes: int = _MIB, port: int = BULK_PORT
) -> Throughput:
    """Send ``total_bytes`` in ``message_bytes`` messages from the stage0 namespace to the stage1 one."""
    count = max(1, total_bytes // message_bytes)
    rate = lab.shaping.rate or 10**9
    timeout = 30.0 + 3 * message_bytes * 8 / rate  # per message
    deadline = 150.0 + 3 * count * message_bytes * 8 / rate
    result = _probe(lab, ("send", "recv"), port, count, message_bytes, timeout, deadline, "throughput")
    return Throughput(**result)


def measure_round_trip(lab: Lab, host: str, port: int, count: int = 20, size: int = 16384) -> list[float]:
    """Seconds of ``count`` round trips of a ``size``-byte message (one rollout step's features) from
    stage0's namespace to ``host`` (stage1, or the delay relay in front of it)."""
    rate = lab.shaping.rate or 10**9
    timeout = 30.0 + 3 * size * 8 / rate + 2 * lab.shaping.delay
    return _probe(lab, ("ping", "echo"), port, count, size, timeout, 150.0 + count * timeout, "round trip",
                  host)["rtt_s"]
