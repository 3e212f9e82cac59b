"""The figures in docs/benchmarks/reliability.md: what a hostile peer can make a stage hold, and how soon a
dead or silent peer is noticed (`splitrl bench reliability`).

Memory: the victim is a binding transport with the stages' limits in a process of its own (`victim_main`,
started by `Victim`), printing its VmRSS and VmHWM (peak) after every receive, so the hostile side's own
buffers do not count. The hostile sides use only pyzmq or sockets, msgpack and the byte layout of
docs/PROTOCOL.md, never splitrl's encoder: what they send is what anyone could.

Detection: a split run over loopback with ``--timeout 600`` (so only liveness can end it early); 5 s
after stage1 says "stage0 connected" the victim gets SIGSTOP (a host gone silent) or SIGKILL (a process
gone); the time is from the signal to the survivor's exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgpack

__all__ = ["victim_main", "Victim", "zmq_oversized_frame", "zmq_refused_connections", "zmq_many_parts",
           "tcp_announced_frame", "detection", "DETECTION_CASES", "run_reliability"]

MIB = 1 << 20

_LINK = ["--total-steps", "8192", "--num-steps", "2048", "--threads", "1", "--max-episode-steps", "200"]


def _status(key: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith(key))


def victim_main(transport: str, endpoint: str, receives: int, timeout: float) -> None:
    """Bind ``endpoint`` with the stages' limits, print the address, then one JSON line per receive
    (what arrived or the error, VmRSS and VmHWM in MiB). Its allocator keeps freed memory as a stage's does
    (`splitrl.allocator`), so the bounds measured are a stage's."""
    from ..allocator import keep_freed_memory
    from ..stages import LIMITS
    from ..transport import PeerGone, ProtocolError, TcpTransport, TransportTimeout, ZmqTransport

    keep_freed_memory()

    cls = ZmqTransport if transport == "zmq" else TcpTransport
    link = cls(endpoint, bind=True, timeout=timeout, limits=LIMITS, heartbeat=5)
    print(json.dumps({"what": "ready", "endpoint": link.endpoint, "rss": _status("VmRSS:"),
                      "hwm": _status("VmHWM:")}), flush=True)
    for _ in range(receives):
        try:
            what = link.recv().kind
        except (ProtocolError, TransportTimeout, PeerGone) as exc:
            what = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps({"what": what, "rss": _status("VmRSS:"), "hwm": _status("VmHWM:")}), flush=True)
    link.close()


class Victim:
    """`victim_main` in a child process; `line()` reads its next report."""

    def __init__(self, transport: str, receives: int, timeout: float = 3.0, endpoint: str = "tcp://127.0.0.1:0"):
        self.proc = subprocess.Popen([sys.executable, "-m", "splitrl.bench.reliability", "victim", transport, endpoint,
                                      str(receives), str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        ready = self.line()
        self.endpoint, self.rss, self.hwm = ready["endpoint"], ready["rss"], ready["hwm"]

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"the victim stopped: {self.proc.stderr.read()[-2000:]}")
        return json.loads(out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> "Victim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _head(seq: int, tensors: int = 0, size: int = MIB, kind: str = "step") -> bytes:
    """A header frame (section 2) announcing ``tensors`` uint8 tensors of ``size`` bytes each."""
    return msgpack.packb({"v": 1, "k": kind, "s": seq, "h": {},
                          "t": [[f"t{i}", "uint8", [size], i + 1] for i in range(tensors)]})


def _push(ctx: Any, endpoint: str) -> Any:
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(endpoint)
    return sock


def _grown(victim: Victim, report: dict[str, Any]) -> dict[str, float]:
    return {"rss_growth_mib": round(report["rss"] - victim.rss, 1), "peak_growth_mib": round(report["hwm"] - victim.hwm, 1)}


def zmq_oversized_frame() -> dict[str, Any]:
    """One 257 MiB frame (the limit is 256 MiB) from the admitted peer, then a small message."""
    import zmq

    with Victim("zmq", 2) as victim:
        ctx = zmq.Context()
        try:
            sock = _push(ctx, victim.endpoint)
            sock.send_multipart([_head(0, 1, 257 * MIB), bytes(257 * MIB)])
            first = victim.line()
            sock.send_multipart([_head(1)])
            after = victim.line()
        finally:
            ctx.destroy(linger=0)
    return {"case": "zmq: a 257 MiB frame (limit 256 MiB)", "outcome": first["what"][:120],
            "next_message": after["what"][:120], **_grown(victim, after)}


def zmq_refused_connections(intruders: int = 32, messages: int = 8) -> dict[str, Any]:
    """While one peer holds the socket, ``intruders`` further connections each try to queue ``messages``
    messages of 8 MiB; then the holder's one message is received."""
    import zmq

    with Victim("zmq", 2, timeout=20) as victim:
        ctx = zmq.Context()
        try:
            holder = _push(ctx, victim.endpoint)
            holder.send_multipart([_head(0)])
            first = victim.line()  # the holder's connection is admitted, and the victim waits for more
            if first["what"] != "step":
                raise RuntimeError(f"the holder's first message did not arrive: {first['what']}")
            blob = bytes(MIB)
            offered = 0
            for sock in [_push(ctx, victim.endpoint) for _ in range(intruders)]:
                for seq in range(messages):
                    try:
                        sock.send_multipart([_head(seq, 8)] + [blob] * 8, flags=zmq.NOBLOCK)
                        offered += 8
                    except zmq.Again:
                        break
            time.sleep(2)  # whatever the intruders could queue has arrived by now
            holder.send_multipart([_head(1)])
            got = victim.line()
        finally:
            ctx.destroy(linger=0)
    return {"case": f"zmq: {intruders} more connections offering {offered} MiB while one holds the socket",
            "outcome": got["what"][:120], **_grown(victim, got)}


def zmq_many_parts(parts: int = 100) -> dict[str, Any]:
    """One message of ``parts`` + 1 parts (1 MiB each; 65 are allowed) from the admitted peer, then a small one."""
    import zmq

    with Victim("zmq", 2) as victim:
        ctx = zmq.Context()
        try:
            sock = _push(ctx, victim.endpoint)
            sock.send_multipart([_head(0)] + [bytes(MIB)] * parts)
            dropped = victim.line()
            sock.send_multipart([_head(0)])
            after = victim.line()
        finally:
            ctx.destroy(linger=0)
    return {"case": f"zmq: a message of {parts + 1} parts, {parts} MiB (65 allowed)", "outcome": dropped["what"][:120],
            "next_message": after["what"][:120], "during": _grown(victim, dropped), **_grown(victim, after)}


def tcp_announced_frame(announced: int = 200 * MIB, sent: int = 16 * 1024) -> dict[str, Any]:
    """A frame announced at ``announced`` bytes of which ``sent`` arrive (plain TCP framing, section 10)."""
    with Victim("tcp", 1, timeout=2.0) as victim:
        host, port = victim.endpoint.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as peer:
            header = _head(0, 1, announced)
            peer.sendall(struct.pack("<IQ", 2, len(header)) + header + struct.pack("<Q", announced) + bytes(sent))
            got = victim.line()
    return {"case": f"tcp: a frame announced at {announced // MIB} MiB, {sent // 1024} KB sent",
            "outcome": got["what"][:120], **_grown(victim, got)}


DETECTION_CASES = [("stage0", "SIGSTOP", "zmq"), ("stage1", "SIGSTOP", "zmq"), ("stage0", "SIGKILL", "zmq"),
                   ("stage1", "SIGKILL", "zmq"), ("stage0", "SIGKILL", "tcp"), ("stage1", "SIGKILL", "tcp")]
"""(victim, signal, transport): a silent host and a killed process on each side; the plain TCP link is
not shown silent (a stopped process's kernel answers keepalive probes; docs/PROTOCOL.md section 10)."""


def detection(victim: str, how: str, heartbeat: float, transport: str = "zmq") -> dict[str, Any]:
    from ..launch import free_port_pair

    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as tmp:
        common = [*_LINK, "--timeout", "600", "--heartbeat", str(heartbeat), "--transport", transport]
        logs = {side: open(Path(tmp) / f"{side}.log", "w+") for side in ("stage1", "stage0")}
        procs = {
            "stage1": subprocess.Popen([sys.executable, "-m", "splitrl", "stage1", "--bind", endpoint,
                                        "--run-dir", f"{tmp}/s1", *common], stdout=logs["stage1"],
                                       stderr=subprocess.STDOUT, env=env),
            "stage0": subprocess.Popen([sys.executable, "-m", "splitrl", "stage0", "--connect", endpoint,
                                        "--run-dir", f"{tmp}/s0", *common], stdout=logs["stage0"],
                                       stderr=subprocess.STDOUT, env=env),
        }
        other = "stage1" if victim == "stage0" else "stage0"
        try:
            deadline = time.monotonic() + 180
            while "stage0 connected" not in (Path(tmp) / "stage1.log").read_text():
                if time.monotonic() > deadline:
                    raise RuntimeError("the session did not start")
                time.sleep(0.2)
            time.sleep(5)
            start = time.monotonic()
            procs[victim].send_signal(getattr(signal, how))
            code = procs[other].wait(300)
            seconds = time.monotonic() - start
            said = [line for line in (Path(tmp) / f"{other}.log").read_text().splitlines() if line.strip()][-1]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            for log in logs.values():
                log.close()
    return {"victim": victim, "signal": how, "transport": transport, "heartbeat_s": heartbeat,
            "detected_after_s": round(seconds, 2), "survivor_exit": code, "survivor_said": said[-160:]}


def run_reliability(heartbeat: float = 2.0, echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Every memory case, then every detection case; each row is echoed as it is measured."""
    rows: dict[str, Any] = {"memory": [], "detection": []}
    for measure in (tcp_announced_frame, zmq_oversized_frame, zmq_refused_connections, zmq_many_parts):
        rows["memory"].append(measure())
        echo(json.dumps(rows["memory"][-1]))
    for victim, how, transport in DETECTION_CASES:
        rows["detection"].append(detection(victim, how, heartbeat, transport))
        echo(json.dumps(rows["detection"][-1]))
    return rows


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "victim":
    victim_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
