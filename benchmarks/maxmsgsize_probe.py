"""Can ``ZMQ_MAXMSGSIZE`` give a binding socket a byte budget for the peer it has admitted but not yet heard
the hello of? What libzmq holds for one such peer, with and without a small limit.

    python benchmarks/maxmsgsize_probe.py [--cases today,small-limit,small-parts,raised] [--scale 1.0]

The receiver (a PULL socket, bound, as stage1's) runs in a process of its own and prints its VmRSS and
VmHWM (peak) after each receive; this process connects a PUSH socket and sends, as any admitted peer could:

- ``today``: one message of 40 parts of 16 MiB under the transport's limit (the largest frame, 256 MiB);
- ``small-limit``: the same under a limit of 64 KiB (what a hello needs: frame 0 at most), then a hello;
- ``small-parts``: 640 MiB in parts of 64 KiB under that 64 KiB limit, then a hello;
- ``raised``: a hello under the 64 KiB limit, the limit raised to 256 MiB on the socket, then a 1 MiB frame
  and a hello on the same connection.

The two answers it gives (docs/benchmarks/reliability.md): libzmq applies the limit to each part, not to
a message, so small parts pass whatever their number; and a connection keeps the limit the socket had when
it was accepted, so one raised after the hello does not reach the stage0 that sent it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import zmq

MIB = 1 << 20
CASES = ("today", "small-limit", "small-parts", "raised")

_RECEIVER = r'''
import json, sys, zmq
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))
limit, raise_to, count = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.setsockopt(zmq.MAXMSGSIZE, limit)
pull.setsockopt(zmq.RCVTIMEO, 5000)
port = pull.bind_to_random_port("tcp://127.0.0.1")
print(json.dumps({"port": port, "rss": status("VmRSS:"), "hwm": status("VmHWM:")}), flush=True)
for i in range(count):
    try:
        parts = pull.recv_multipart(copy=False)
        what = f"{len(parts)} part(s), {sum(len(p.buffer) for p in parts) / 2**20:.1f} MiB"
        del parts
    except zmq.Again:
        what = "nothing within 5 s (the connection was dropped)"
    if i == 0 and raise_to:
        pull.setsockopt(zmq.MAXMSGSIZE, raise_to)
    print(json.dumps({"what": what, "rss": status("VmRSS:"), "hwm": status("VmHWM:")}), flush=True)
pull.close(0)
ctx.term()
'''


def probe(limit: int, messages: list[list[bytes]], raise_to: int = 0) -> list[dict[str, Any]]:
    """Send ``messages`` to a receiver whose socket has ``MAXMSGSIZE`` ``limit`` (``raise_to``: set after its first
    receive); what it got for each, and its RSS and peak growth in MiB since it bound."""
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(limit), str(raise_to), str(len(messages))],
                                stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        assert receiver.stdout is not None
        ready = json.loads(receiver.stdout.readline())
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDTIMEO, 10_000)
        push.connect(f"tcp://127.0.0.1:{ready['port']}")
        out = []
        for parts in messages:
            push.send_multipart(parts)
            line = receiver.stdout.readline()
            if not line:
                raise RuntimeError("the receiver stopped")
            got = json.loads(line)
            out.append({"got": got["what"], "rss_growth_mib": round(got["rss"] - ready["rss"], 1),
                        "peak_growth_mib": round(got["hwm"] - ready["hwm"], 1)})
        receiver.wait(30)
        return out
    finally:
        ctx.destroy(linger=0)
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(10)


def run_case(case: str, scale: float = 1.0) -> dict[str, Any]:
    """One of `CASES`; ``scale`` shrinks the bytes sent (a test's quick run)."""
    hello = [b"h" * 1000]
    part = max(1, int(16 * MIB * scale))
    small = 64 * 1024
    if case == "today":
        limit, raise_to, messages = 256 * MIB, 0, [[b"x" * part] * 40, hello]
    elif case == "small-limit":
        limit, raise_to, messages = small, 0, [[b"x" * part] * 40, hello]
    elif case == "small-parts":
        limit, raise_to, messages = small, 0, [[b"y" * small] * max(1, int(40 * 256 * scale)), hello]
    elif case == "raised":
        limit, raise_to, messages = small, 256 * MIB, [hello, [b"z" * MIB], hello]
    else:
        raise ValueError(f"unknown case {case!r}: one of {', '.join(CASES)}")
    return {"case": case, "maxmsgsize": limit, "raised_to": raise_to, "receives": probe(limit, messages, raise_to)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    for case in args.cases.split(","):
        print(json.dumps(run_case(case, args.scale)), flush=True)


if __name__ == "__main__":
    main()
