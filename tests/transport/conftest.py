"""Fixtures of the ZmqTransport tests (test_zmq.py, test_gate.py, test_handshake.py): transports and bare
sockets, closed at teardown. A test module's own fixture of the same name (another transport's ``pair``)
takes precedence in that module.

Every receive has a timeout of at most 5 s and every socket is closed in a fixture
or a ``finally``, so no test can hang or leak a socket into the next one.
"""

from __future__ import annotations

import sys

import pytest
import zmq

from splitrl.transport import ZmqTransport

from .zmq_support import T, endpoint_for


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes any socket a failing test left open


@pytest.fixture
def make(ctx):
    """``make(endpoint, bind=..., **kw)`` -> a ZmqTransport closed at teardown."""
    made: list[ZmqTransport] = []

    def _make(endpoint: str, *, bind: bool, **kw) -> ZmqTransport:
        kw.setdefault("timeout", T)
        kw.setdefault("linger", 0.0)
        t = ZmqTransport(endpoint, bind=bind, context=ctx, **kw)
        made.append(t)
        return t

    yield _make
    for t in made:
        t.close()


@pytest.fixture(params=["tcp", "ipc", "inproc"])
def pair(request, make, tmp_path):
    """(binder, connector) over every kind of endpoint."""
    if request.param == "ipc" and (sys.platform == "win32" or len(str(tmp_path)) > 90):
        pytest.skip("ipc needs a POSIX path shorter than sun_path")
    binder = make(endpoint_for(request.param, tmp_path), bind=True, name="stage0")  # name: who is at the other end
    connector = make(binder.endpoint, bind=False, name="stage1")
    return binder, connector


@pytest.fixture
def tcp_pair(make):
    binder = make("tcp://127.0.0.1:0", bind=True, name="stage0")  # name: who is at the other end
    connector = make(binder.endpoint, bind=False, name="stage1")
    return binder, connector


@pytest.fixture
def raw_push(ctx):
    """A bare PUSH socket connected to a transport's receiving (PULL) endpoint."""
    sockets: list[zmq.Socket] = []

    def _connect(endpoint: str) -> zmq.Socket:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(T * 1000))
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield _connect
    for sock in sockets:
        sock.close(linger=0)
