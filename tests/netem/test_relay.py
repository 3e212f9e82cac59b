"""The delay relay: every byte arrives, in order, no sooner than the delay each way."""

import socket
import subprocess
import sys
import threading
import time

import pytest

from splitrl.launch import free_port
from splitrl.netem.netns import wait_for_line

from ..conftest import child_env

# Namespaces are the machine's: no other test worker makes any while this module runs (make test: several workers).
pytestmark = pytest.mark.usefixtures("netns_module")


def _echo_server(port: int, stop: threading.Event) -> threading.Thread:
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(0.2)

    def serve() -> None:
        with listener:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    while data := conn.recv(65536):
                        conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def relayed(tmp_path):
    """An echo server on 127.0.0.1:PORT and a relay to it on 127.0.0.2:PORT (loopback is all of 127/8)."""
    port = free_port()
    stop = threading.Event()
    _echo_server(port, stop)
    procs = []

    def start(delay: str, jitter: str = "0ms") -> int:
        proc = subprocess.Popen([sys.executable, "-m", "splitrl.netem.relay", "--listen", f"127.0.0.2:{port}",
                                 "--to", "127.0.0.1", "--delay", delay, "--jitter", jitter],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
        procs.append(proc)
        assert wait_for_line(proc, "relay ready", timeout=60), "the relay did not start"
        return port

    yield start
    stop.set()
    for proc in procs:
        proc.kill()
        proc.wait(10)


def _receive(conn: socket.socket, size: int) -> bytes:
    got = b""
    while len(got) < size:
        chunk = conn.recv(65536)  # the socket's timeout bounds each wait
        if not chunk:
            raise AssertionError(f"the relay closed the connection after {len(got)} of {size} bytes")
        got += chunk
    return got


def _round_trip(port: int, payload: bytes) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.2", port), timeout=10) as conn:
        start = time.perf_counter()
        conn.sendall(payload)
        got = _receive(conn, len(payload))
        return got, time.perf_counter() - start


def test_a_round_trip_takes_at_least_the_delay_each_way(relayed):
    port = relayed("40ms")
    got, seconds = _round_trip(port, b"ping")
    assert got == b"ping"
    assert seconds >= 0.080  # 40 ms there and 40 ms back: a lower bound, not a timing target


def test_jitter_never_reorders_and_nothing_is_lost(relayed):
    port = relayed("5ms", "4ms")
    payload = b"".join(i.to_bytes(4, "big") for i in range(50_000))  # 200 kB in many chunks
    with socket.create_connection(("127.0.0.2", port), timeout=10) as conn:
        for i in range(0, len(payload), 1000):  # many small writes: many chunks, each with its own jitter
            conn.sendall(payload[i: i + 1000])
        got = _receive(conn, len(payload))
    assert got == payload


def test_bad_arguments_are_refused():
    done = subprocess.run([sys.executable, "-m", "splitrl.netem.relay", "--listen", "127.0.0.2:9", "--to", "127.0.0.1",
                           "--delay", "1ms", "--jitter", "5ms"], capture_output=True, text=True, env=child_env())
    assert done.returncode == 2 and "jitter" in done.stderr
