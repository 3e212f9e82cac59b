"""Byte accounting: what each side's application sent beside its veth end's kernel counters.

Each veth end counts what the kernel sent; the stages' meters count frame payloads
(docs/PROTOCOL.md section 9). The kernel's bytes include 66 bytes of headers per
packet (see `splitrl.netem.netns`: GSO is off on the veth, so a packet is one TCP
segment), so the report gives both the raw ratio and the ratio after subtracting
``tx_packets x 66``. What remains after the correction is named in the report:
ZeroMQ's own framing (a 64-byte greeting and a READY command per connection, 2 bytes
per frame up to 255 bytes, 9 above), SYN options (+8 bytes each), ARP (-24 each) and
retransmitted segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..runs import link_bytes, link_messages, read_metrics

__all__ = ["SideBytes", "app_bytes_from_metrics"]


@dataclass(frozen=True)
class SideBytes:
    """What one side's application sent beside its veth end's kernel counters."""

    side: str
    dev: str
    app_sent: int
    app_messages: int
    tx_bytes: int
    tx_packets: int
    header_bytes: int
    """Per packet (see `Lab.header_bytes`)."""
    tcp: dict[str, int] = field(default_factory=dict)
    """Deltas of the namespace's TCP counters over the run (OutSegs, RetransSegs, AttemptFails, ...)."""

    @property
    def headers(self) -> int:
        return self.tx_packets * self.header_bytes

    @property
    def corrected(self) -> int:
        """Kernel bytes minus the headers: the TCP payload, i.e. the ZeroMQ byte stream."""
        return self.tx_bytes - self.headers

    @property
    def raw_ratio(self) -> float:
        return self.tx_bytes / self.app_sent if self.app_sent else float("nan")

    @property
    def corrected_ratio(self) -> float:
        return self.corrected / self.app_sent if self.app_sent else float("nan")

    @property
    def residual(self) -> int:
        return self.corrected - self.app_sent


def _close_bytes(seq: int) -> int:
    """Bytes of stage0's final ``close`` message (sent after its last metrics line), by the reference encoder."""
    from ..transport.wire import encode, frame_nbytes

    return sum(frame_nbytes(f) for f in encode("close", seq))


def app_bytes_from_metrics(run_dir: str | Path) -> dict[str, tuple[int, int]]:
    """(bytes, messages) each side sent, from stage0's last metrics line.

    stage0: its meter's ``net_total/*/sent_*`` (the handshake included) plus the
    ``close`` message that follows the last line. stage1 writes no meter of its
    own; by the protocol (docs/PROTOCOL.md section 9: the same number on both
    sides) what it sent is what stage0's meter received, ``net_total/*/recv_*``.
    """
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    last = records[-1]
    sent_messages = link_messages(last, "sent", everything=True)
    return {
        "stage0": (link_bytes(last, "sent", everything=True) + _close_bytes(sent_messages), sent_messages + 1),
        "stage1": (link_bytes(last, "recv", everything=True), link_messages(last, "recv", everything=True)),
    }
