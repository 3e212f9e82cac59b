"""TorchRpcTransport: the paper's link as a Transport, loopback only, every wait bounded.

Each end runs in its own spawned process (an RPC agent is per process), reporting
what it saw over a pipe that the test polls with a timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from splitrl.launch import free_port
from splitrl.transport.torch_rpc import TorchRpcTransport

T = 20.0


def listening_addresses() -> list[str]:
    """Local addresses of this process's listening TCP sockets, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].split(":")[0])
    return found


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc writes them


def _binder(endpoint: str, out: Connection) -> None:
    try:
        with TorchRpcTransport(endpoint, bind=True, timeout=T) as link:
            listening = listening_addresses()
            msg = link.recv()
            tensors = {k: v.clone() for k, v in msg.tensors.items()}
            # The connector waits for the reply, so nothing comes now: a receive must give up.
            try:
                link.recv(timeout=0.5)
                out.send(("error", "a receive returned without a message"))
                return
            except Exception as exc:  # noqa: BLE001 - its type is what we report
                timed_out = type(exc).__name__
            link.send("reply", {"y": tensors["x"] * 2, "empty": tensors["empty"]}, header={"n": msg.header["n"] + 1})
            done = link.recv()
            out.send(("ok", {"kind": msg.kind, "header": msg.header, "x": tensors["x"].tolist(), "timed_out": timed_out,
                             "done": done.kind, "meter": link.meter.snapshot(), "listening": listening}))
    except BaseException:
        out.send(("error", traceback.format_exc()))


def _connector(endpoint: str, out: Connection) -> None:
    try:
        with TorchRpcTransport(endpoint, bind=False, timeout=T) as link:
            x = torch.arange(4096, dtype=torch.float32)
            sent = link.send("hello", {"x": x, "empty": torch.empty(0, dtype=torch.bfloat16)}, header={"n": 41})
            reply = link.recv()
            link.send("done")
            out.send(("ok", {"kind": reply.kind, "header": reply.header, "y": reply.tensors["y"].tolist(),
                             "empty": str(reply.tensors["empty"].dtype), "empty_n": reply.tensors["empty"].numel(),
                             "sent": sent}))
    except BaseException:
        out.send(("error", traceback.format_exc()))


def _result(conn: Connection) -> Any:
    assert conn.poll(90), "an end reported nothing within 90 s"
    status, value = conn.recv()
    assert status == "ok", value
    return value


def test_round_trip_between_two_processes_counts_the_frames() -> None:
    ctx = multiprocessing.get_context("spawn")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ends = []
    procs = []
    try:
        for target in (_binder, _connector):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(endpoint, child), daemon=True)
            proc.start()
            ends.append(parent)
            procs.append(proc)
        binder, connector = _result(ends[0]), _result(ends[1])
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert binder["kind"] == "hello" and binder["header"] == {"n": 41}
    # (Results cross the test's pipe as plain lists: torch would share tensors by fd, which dies with the process.)
    assert binder["x"] == torch.arange(4096, dtype=torch.float32).tolist()
    assert binder["timed_out"] == "TransportTimeout"
    assert binder["done"] == "done"
    # RPC unpickles what arrives: nothing of it may listen beyond loopback (store, TensorPipe, gloo).
    assert binder["listening"] and set(binder["listening"]) <= LOOPBACK_HEX, binder["listening"]
    assert connector["kind"] == "reply" and connector["header"] == {"n": 42}
    assert connector["y"] == (torch.arange(4096, dtype=torch.float32) * 2).tolist()
    assert connector["empty"] == "torch.bfloat16" and connector["empty_n"] == 0
    # The meters count our frames, the same bytes any other transport would carry.
    assert binder["meter"]["net/hello/recv_bytes"] == connector["sent"] > 4096 * 4


@pytest.mark.parametrize("endpoint", ["tcp://10.1.2.3:5555", "tcp://192.0.2.1:5555"])
def test_refuses_anything_but_loopback(endpoint: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        TorchRpcTransport(endpoint, bind=True, timeout=1.0)


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/x", "tcp://127.0.0.1", "inproc://x"])
def test_needs_a_tcp_endpoint(endpoint: str) -> None:
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        TorchRpcTransport(endpoint, bind=True, timeout=1.0)
