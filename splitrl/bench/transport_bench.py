"""Transport benchmark: one-way throughput and round-trip latency against raw pyzmq.

Each measured message carries one bfloat16 tensor of ``size`` bytes. Transports:

- ``raw-zmq``: plain pyzmq PUSH/PULL, the tensor bytes as one frame
  (``send(memoryview, copy=False)``, ``recv(copy=False)``) -- the baseline;
- ``raw-torch``: raw-zmq plus the least a transport that hands over torch tensors and refuses NaN does, and
  no framing: a fixed header frame and the tensor's bytes (a view of the tensor, copied below pyzmq's
  zero-copy threshold as `ZmqTransport` does), the receiver wrapping the frame in a tensor and checking its
  values finite (`wire._all_finite`) -- the floor a framed transport's ratios can be read against;
- ``zmq``: `ZmqTransport` (msgpack header frame + tensor frame, decode on receipt);
- ``tcp``: `TcpTransport` (the same frames over one plain TCP connection);
- ``torch-rpc``: `TorchRpcTransport` (the same frames as ``rpc_sync`` calls: the paper's link).

Endpoint kinds: ``tcp`` (loopback) and ``ipc`` put the peer in a separate process
started with 'spawn', as the real stages are; ``inproc`` (ZeroMQ only) puts it in a
thread of this process, so its numbers include GIL hand-offs between the two
threads. Both raw and framed ZeroMQ use the same high-water mark and linger, so
the comparison isolates framing, encoding and decoding.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import statistics
import tempfile
import threading
import time
import traceback
import uuid
from multiprocessing.connection import Connection
from typing import Any, Iterable, Sequence

import torch
import zmq

from splitrl.launch import free_port
from splitrl.transport import TcpTransport, Transport, ZmqTransport, wire
from splitrl.transport.zmq_transport import DEFAULT_HWM

__all__ = ["run_transport_bench", "format_table", "TRANSPORTS", "ENDPOINTS"]

log = logging.getLogger(__name__)

TRANSPORTS = ("raw-zmq", "raw-torch", "zmq", "tcp", "torch-rpc")
ENDPOINTS = ("tcp", "ipc", "inproc")
DATA_TIMEOUT_S = 10.0
"""Every receive on the measured link gives up after this long."""
START_TIMEOUT_S = 120.0
"""A spawned peer must import torch and open its link within this long."""
_SESSION = 1
_DATA_KIND = "data"
_END_KIND = "end"
_WARMUP = 50
_MAX_RTT_SAMPLES = 200_000


# -- links: the same four operations over each transport ----------------------------


class _RawZmqLink:
    """PUSH/PULL pair, one frame per message; an empty frame marks the end of a run."""

    def __init__(self, config: dict[str, Any], *, bind: bool) -> None:
        ctx = zmq.Context.instance()
        self._push = ctx.socket(zmq.PUSH)
        self._pull = ctx.socket(zmq.PULL)
        for sock in (self._push, self._pull):
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
            sock.setsockopt(zmq.RCVHWM, DEFAULT_HWM)
            sock.setsockopt(zmq.RCVTIMEO, int(DATA_TIMEOUT_S * 1000))
            sock.setsockopt(zmq.SNDTIMEO, int(DATA_TIMEOUT_S * 1000))
        self.config = dict(config)
        if bind:
            # The binder's PULL is the connector's PUSH target and vice versa.
            self.config["to_binder"] = self._bind(self._pull, config["to_binder"])
            self.config["to_peer"] = self._bind(self._push, config["to_peer"])
        else:
            self._push.connect(config["to_binder"])
            self._pull.connect(config["to_peer"])

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint[: -len(":0")])
            return f"{endpoint[: -len(':0')]}:{port}"
        sock.bind(endpoint)
        return endpoint

    def payload(self, tensor: torch.Tensor) -> Any:
        return memoryview(tensor.view(torch.uint8).numpy())

    def send(self, payload: Any) -> None:
        self._push.send(payload, copy=False)

    def send_end(self) -> None:
        self._push.send(b"")

    def recv(self) -> Any | None:
        try:
            frame = self._pull.recv(copy=False)
        except zmq.Again:
            raise TimeoutError(f"raw zmq: no message within {DATA_TIMEOUT_S:g} s") from None
        return frame if len(frame) else None

    def echo(self, item: Any) -> None:
        self._push.send(item, copy=False)

    def close(self) -> None:
        self._push.close()
        self._pull.close()


class _RawTorchLink(_RawZmqLink):
    """``raw-torch``: raw pyzmq with a tensor at each end (see the module's docstring); an empty frame ends a run."""

    _HEADER = b"x" * 40  # about what a data message's header frame weighs

    def payload(self, tensor: torch.Tensor) -> Any:
        return tensor

    def send(self, payload: Any) -> None:
        frame = memoryview(payload.view(torch.int16).numpy()).cast("B")
        self._push.send(self._HEADER, zmq.SNDMORE)
        self._push.send(frame, copy=frame.nbytes < zmq.COPY_THRESHOLD)

    def recv(self) -> Any | None:
        head = super().recv()
        if head is None:
            return None
        frame = memoryview(self._pull.recv(copy=False))
        tensor = torch.frombuffer(frame, dtype=torch.bfloat16)
        if not wire._all_finite(tensor, frame):
            raise RuntimeError("raw-torch: a non-finite value")
        return tensor

    echo = send


class _TransportLink:
    """A splitrl `Transport`; a message of kind ``end`` marks the end of a run."""

    def __init__(self, config: dict[str, Any], *, bind: bool) -> None:
        self.config = dict(config)
        cls: type[Transport]
        if config["transport"] == "torch-rpc":
            from splitrl.transport.torch_rpc import TorchRpcTransport

            cls = TorchRpcTransport
        else:
            cls = ZmqTransport if config["transport"] == "zmq" else TcpTransport
        self.transport = cls(config["endpoint"], bind=bind, timeout=DATA_TIMEOUT_S)
        # As the stages' handshake leaves a link: every message carries the session id, and the receiver learns
        # the session's layouts (`FastWire.decode`'s known path).
        self.transport.session = _SESSION
        self.config["endpoint"] = self.transport.endpoint  # type: ignore[attr-defined]

    def payload(self, tensor: torch.Tensor) -> Any:
        return {"x": tensor}

    def send(self, payload: Any) -> None:
        self.transport.send(_DATA_KIND, payload)

    def send_end(self) -> None:
        self.transport.send(_END_KIND)

    def recv(self) -> Any | None:
        msg = self.transport.recv()
        return None if msg.kind == _END_KIND else msg

    def echo(self, item: Any) -> None:
        self.transport.send(_DATA_KIND, item.tensors)

    def close(self) -> None:
        self.transport.close()


_Link = _RawZmqLink | _TransportLink


def _open_link(config: dict[str, Any], *, bind: bool) -> _Link:
    raw = {"raw-zmq": _RawZmqLink, "raw-torch": _RawTorchLink}.get(config["transport"])
    return raw(config, bind=bind) if raw is not None else _TransportLink(config, bind=bind)


# -- the peer: a sink or an echo, driven over a control pipe ------------------------


def _serve(config: dict[str, Any], ctrl: Connection) -> None:
    """Peer side: open the link (connecting), then obey ``sink``/``echo``/``stop`` commands."""
    link: _Link | None = None
    try:
        link = _open_link(config, bind=False)
        ctrl.send(("ready", None))
        while ctrl.poll(START_TIMEOUT_S):
            command = ctrl.recv()
            if command == "stop":
                break
            count = 0
            while (item := link.recv()) is not None:
                if command == "echo":
                    link.echo(item)
                count += 1
                del item  # frees the frame before the next one arrives
            ctrl.send((command, count))
    except BaseException:  # reported to the driver, which raises it with context
        try:
            ctrl.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if link is not None:
            link.close()


def _peer_process_main(config: dict[str, Any], ctrl: Connection) -> None:
    _serve(config, ctrl)


def _expect(ctrl: Connection, tag: str, timeout: float) -> Any:
    try:
        if not ctrl.poll(timeout):
            raise TimeoutError(f"benchmark peer sent no {tag!r} within {timeout:g} s")
        got, value = ctrl.recv()
    except (EOFError, ConnectionError):
        raise RuntimeError(f"benchmark peer exited before sending {tag!r} (see its traceback above)") from None
    if got == "error":
        raise RuntimeError(f"benchmark peer failed:\n{value}")
    if got != tag:
        raise RuntimeError(f"benchmark peer: expected {tag!r}, got {got!r}")
    return value


# -- measurements --------------------------------------------------------------------


def _throughput(link: _Link, ctrl: Connection, payload: Any, seconds: float) -> tuple[float, int]:
    """Stream for ``seconds``; the clock stops when the peer confirms it received everything."""
    ctrl.send("sink")
    sent = 0
    start = time.perf_counter()
    stop = start + seconds
    while True:
        link.send(payload)
        sent += 1
        if time.perf_counter() >= stop:
            break
    link.send_end()
    received = _expect(ctrl, "sink", DATA_TIMEOUT_S)
    elapsed = time.perf_counter() - start
    if received != sent:
        raise RuntimeError(f"throughput run lost messages: sent {sent}, peer received {received}")
    return elapsed, sent


def _round_trips(link: _Link, ctrl: Connection, payload: Any, seconds: float, warmup: int) -> list[float]:
    """Ping-pong the same message for ``seconds``; returns round-trip times in microseconds."""
    ctrl.send("echo")
    for _ in range(warmup):
        link.send(payload)
        if link.recv() is None:
            raise RuntimeError("benchmark peer ended the echo run early")
    samples: list[float] = []
    stop_ns = time.perf_counter_ns() + int(seconds * 1e9)
    while len(samples) < _MAX_RTT_SAMPLES:
        t0 = time.perf_counter_ns()
        link.send(payload)
        item = link.recv()
        t1 = time.perf_counter_ns()
        if item is None:
            raise RuntimeError("benchmark peer ended the echo run early")
        del item
        samples.append((t1 - t0) / 1000)
        if t1 >= stop_ns:
            break
    link.send_end()
    _expect(ctrl, "echo", DATA_TIMEOUT_S)
    return samples


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


class _Session:
    """One measured link: the binding end here, the peer in a spawned process (or a thread for inproc)."""

    def __init__(self, transport: str, endpoint_kind: str) -> None:
        self.transport, self.endpoint_kind = transport, endpoint_kind
        self.link: _Link | None = None
        self.ctrl: Connection | None = None
        self.process: Any = None
        self.thread: threading.Thread | None = None
        self.tmpdir = tempfile.mkdtemp(prefix="splitrl-bench-") if endpoint_kind == "ipc" else None

    def start(self) -> None:
        """Bind and launch the peer; `wait_ready` completes the start (so peers can boot in parallel)."""
        if self.endpoint_kind == "tcp":
            base = "tcp://127.0.0.1:0"
        elif self.endpoint_kind == "ipc":
            base = f"ipc://{self.tmpdir}/link"
        else:
            base = f"inproc://splitrl-bench-{uuid.uuid4().hex}"
        config: dict[str, Any] = {"transport": self.transport}
        if self.transport.startswith("raw-"):
            config["to_binder"] = base
            config["to_peer"] = base if self.endpoint_kind == "tcp" else base + "-r"
        else:
            config["endpoint"] = base
        if self.transport == "torch-rpc":
            # Its binding end returns only once the peer has joined: the peer starts first.
            config["endpoint"] = f"tcp://127.0.0.1:{free_port()}"
            self._spawn(config)
            self.link = _open_link(config, bind=True)
            return
        self.link = _open_link(config, bind=True)
        if self.endpoint_kind == "inproc":
            self.ctrl, peer_ctrl = multiprocessing.Pipe()
            self.thread = threading.Thread(target=_serve, args=(self.link.config, peer_ctrl), name="bench-peer", daemon=True)
            self.thread.start()
        else:
            self._spawn(self.link.config)

    def _spawn(self, config: dict[str, Any]) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.ctrl, peer_ctrl = spawn.Pipe()
        self.process = spawn.Process(target=_peer_process_main, args=(config, peer_ctrl), daemon=True)
        self.process.start()
        peer_ctrl.close()

    def wait_ready(self) -> None:
        assert self.ctrl is not None
        _expect(self.ctrl, "ready", START_TIMEOUT_S)

    def measure(self, tensor: torch.Tensor, seconds: float, warmup: int) -> tuple[float, int, list[float]]:
        """(elapsed, messages) of a throughput run and the round-trip samples of a ping-pong run."""
        assert self.link is not None and self.ctrl is not None
        payload = self.link.payload(tensor)
        rtts = _round_trips(self.link, self.ctrl, payload, seconds, warmup)
        elapsed, count = _throughput(self.link, self.ctrl, payload, seconds)
        return elapsed, count, rtts

    def close(self) -> None:
        """Stop the peer (killing it if it does not exit) and release everything; never raises."""
        if self.ctrl is not None:
            try:
                self.ctrl.send("stop")
            except OSError:
                pass
        if self.link is not None and self.transport == "torch-rpc":
            self.link.close()  # its shutdown is collective: both ends close at the same time
        if self.process is not None and self.process.pid is not None:  # pid is None if start() failed
            self.process.join(5.0)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(2.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(2.0)
        if self.thread is not None:
            # The thread's receives time out after DATA_TIMEOUT_S, so this join is bounded.
            self.thread.join(DATA_TIMEOUT_S + 5.0)
        if self.link is not None:
            self.link.close()
        if self.ctrl is not None:
            self.ctrl.close()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def _combinations(transports: Iterable[str], endpoints: Iterable[str]) -> list[tuple[str, str]]:
    transports, endpoints = list(transports), list(endpoints)
    bad = [f"transport {t!r}" for t in transports if t not in TRANSPORTS]
    bad += [f"endpoint {e!r}" for e in endpoints if e not in ENDPOINTS]
    if bad:
        raise ValueError(f"unknown {', '.join(bad)}; transports: {TRANSPORTS}, endpoints: {ENDPOINTS}")
    # TcpTransport and torch RPC speak TCP only; inproc is ZeroMQ's in-process transport.
    pairs = [(t, e) for t in transports for e in endpoints if t not in ("tcp", "torch-rpc") or e == "tcp"]
    if not pairs:
        raise ValueError(f"no transport in {transports} runs over the endpoints {endpoints}")
    return pairs


def run_transport_bench(
    sizes: Sequence[int] = (16, 4096, 16384, 1 << 20),
    transports: Sequence[str] = TRANSPORTS,
    endpoints: Sequence[str] = ENDPOINTS,
    seconds: float = 1.0,
    quick: bool = False,
    rounds: int = 5,
) -> list[dict[str, Any]]:
    """Measure every sensible (transport, endpoint) pair at every message size.

    Returns one row per (transport, endpoint, size) with ``throughput_MBps``
    (tensor payload, 10**6 bytes per second; framing headers not counted),
    ``msgs_per_s``, and the round-trip time's ``rtt_us_median`` and ``rtt_us_p99``
    in microseconds. Each of the two measurements gets about ``seconds`` per
    (pair, size), split into ``rounds`` slices that visit all pairs in turn, so
    a burst of background load hits the baseline and the others alike;
    throughput is the median over slices, round trips are pooled. ``quick``
    cuts everything to one slice of a few tens of milliseconds, for tests.

    Peers for tcp and ipc are started with 'spawn', which re-imports the calling
    script: call this from a function or under ``if __name__ == "__main__":``.
    """
    bad_sizes = [s for s in sizes if not isinstance(s, int) or s < 2 or s % 2]
    if bad_sizes or not sizes:
        raise ValueError(f"sizes must be even byte counts >= 2 (bfloat16 elements), got {list(sizes)}")
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    pairs = _combinations(transports, endpoints)
    if quick:
        rounds, slice_s, warmup = 1, min(seconds, 0.03), 3
    else:
        slice_s, warmup = seconds / rounds, _WARMUP
    sessions = [_Session(t, e) for t, e in pairs]
    throughputs: dict[tuple[int, int], list[tuple[float, int]]] = {}
    rtts: dict[tuple[int, int], list[float]] = {}
    try:
        for session in sessions:
            session.start()
        for session in sessions:
            session.wait_ready()
        for round_index in range(rounds):
            for size in sizes:
                tensor = torch.randn(size // 2, generator=torch.Generator().manual_seed(size)).to(torch.bfloat16)
                for i, session in enumerate(sessions):
                    elapsed, count, samples = session.measure(tensor, slice_s, warmup)
                    throughputs.setdefault((i, size), []).append((elapsed, count))
                    rtts.setdefault((i, size), []).extend(samples)
            log.info("transport bench: round %d of %d done", round_index + 1, rounds)
    finally:
        for session in sessions:
            session.close()

    rows: list[dict[str, Any]] = []
    for i, (transport, endpoint_kind) in enumerate(pairs):
        for size in sizes:
            rate = statistics.median(count / elapsed for elapsed, count in throughputs[(i, size)])
            samples = sorted(rtts[(i, size)])
            rows.append(
                {
                    "transport": transport,
                    "endpoint": endpoint_kind,
                    "size": size,
                    "throughput_MBps": rate * size / 1e6,
                    "msgs_per_s": rate,
                    "rtt_us_median": statistics.median(samples),
                    "rtt_us_p99": _percentile(samples, 0.99),
                }
            )
    order = {name: i for i, name in enumerate(TRANSPORTS)}
    rows.sort(key=lambda r: (r["size"], ENDPOINTS.index(r["endpoint"]), order[r["transport"]]))
    return rows


def _size_text(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of `run_transport_bench` rows, with ratios against raw-zmq.

    ``tput/raw`` is throughput divided by raw pyzmq's at the same endpoint and
    size (higher is better); ``rtt/raw`` is the median round trip divided by
    raw pyzmq's (lower is better). ``-`` where there is no raw-zmq row to compare.
    """
    raw = {(r["endpoint"], r["size"]): r for r in rows if r["transport"] == "raw-zmq"}
    header = ["size", "endpoint", "transport", "MB/s", "msgs/s", "rtt median us", "rtt p99 us", "tput/raw", "rtt/raw"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 6) + "|"]
    for r in rows:
        base = raw.get((r["endpoint"], r["size"]))
        tput_ratio = f"{r['throughput_MBps'] / base['throughput_MBps']:.2f}" if base else "-"
        rtt_ratio = f"{r['rtt_us_median'] / base['rtt_us_median']:.2f}" if base else "-"
        cells = [
            _size_text(r["size"]),
            r["endpoint"],
            r["transport"],
            f"{r['throughput_MBps']:.1f}",
            f"{r['msgs_per_s']:.0f}",
            f"{r['rtt_us_median']:.1f}",
            f"{r['rtt_us_p99']:.1f}",
            tput_ratio,
            rtt_ratio,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
