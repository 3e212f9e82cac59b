"""PyTorch's `torch.distributed.rpc` as a `Transport`: the paper's link, as a baseline.

The paper's code moves features and gradients between its two stages with
``rpc_sync`` calls (TensorPipe underneath). This transport carries our framed
messages the same way, so the transport-swap benchmark can run the very same
stages and schedule over it and compare like with like: each `send` is one
``rpc_sync`` that runs `_deliver` in the peer process, which queues the frames
for the peer's `recv`. The tensor frames travel as uint8 tensors (TensorPipe
sends their storage beside the pickled call); the header frame as bytes.

RPC unpickles every call it receives, which this project never does with data
from the wire. So this transport is for benchmarks and only listens on, and
connects to, loopback addresses. One RPC agent per process: one link per process.
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import os
import queue
import socket
import urllib.parse
import warnings
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch

from .base import Transport
from .endpoints import require_tcp_endpoint
from .errors import TransportTimeout
from .wire import WireLimits

__all__ = ["TorchRpcTransport"]

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0
_BINDER, _CONNECTOR = "splitrl-binder", "splitrl-connector"

_inbox: "queue.Queue[list[Any]]" = queue.Queue()
"""Messages delivered to this process by the peer's calls, in order (rpc_sync returns only after the put)."""


def _deliver(header: bytes, tensors: list[torch.Tensor]) -> None:
    """Runs in the receiving process, on an RPC thread."""
    _inbox.put([header, *tensors])


_SCHEME = "splitrl-loopback"
_IFNAME_VARS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _loopback_rendezvous(url: str, timeout: timedelta = timedelta(seconds=300), **_: Any) -> Iterator[tuple[Any, int, int]]:
    """torch.distributed rendezvous handler: rank 0 serves the store on a socket we bound to loopback."""
    from torch.distributed import TCPStore

    parsed = urllib.parse.urlparse(url)
    query = dict(urllib.parse.parse_qsl(parsed.query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    if rank == 0:
        store = TCPStore(parsed.hostname, parsed.port, world_size, True, timeout,
                         master_listen_fd=os.dup(int(query["fd"])), use_libuv=False)
    else:
        store = TCPStore(parsed.hostname, parsed.port, world_size, False, timeout)
    yield store, rank, world_size
    raise RuntimeError("torch-rpc: the rendezvous is single-use")


def _register_rendezvous() -> None:
    # By module path: torch.distributed.rendezvous is also the name of a function.
    handlers = importlib.import_module("torch.distributed.rendezvous")
    if _SCHEME not in handlers._rendezvous_handlers:
        handlers.register_rendezvous_handler(_SCHEME, _loopback_rendezvous)


def _as_tensor(frame: Any) -> torch.Tensor:
    view = memoryview(frame).cast("B")
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    # frombuffer shares writable memory; a read-only frame (bytes) is copied once.
    return torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)


class TorchRpcTransport(Transport):
    """A `Transport` over ``torch.distributed.rpc`` (TensorPipe, TCP only), loopback only.

    The binding side is rank 0 and hosts the rendezvous store at the endpoint's
    port (port 0 picks a free one); the connecting side is rank 1. Construction
    returns once both have joined, or raises `TransportTimeout` after ``timeout``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool,
        timeout: float = 30.0,
        limits: WireLimits = WireLimits(),
        name: str = "",
    ) -> None:
        super().__init__(peer=name or f"peer at {endpoint}", timeout=timeout, limits=limits)
        from torch.distributed import rpc

        tcp = require_tcp_endpoint(endpoint, "torch-rpc")
        host, port = tcp.address, tcp.port
        try:
            loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            loopback = False
        if not loopback:
            raise ValueError(f"torch-rpc unpickles what it receives, so it is for loopback benchmarks only; got {host!r}")
        if rpc.api._is_current_rpc_agent_set():
            raise RuntimeError("this process already has an RPC agent: torch-rpc allows one link per process")
        self._rpc = rpc
        self._me, self._other = (_BINDER, _CONNECTOR) if bind else (_CONNECTOR, _BINDER)
        listener = None
        if bind:
            # Our own listening socket on the loopback address for the rendezvous store:
            # torch's tcp:// rendezvous would listen on every interface.
            listener = socket.create_server((host, port))
            port = listener.getsockname()[1]
        self.endpoint = f"tcp://{host}:{port}"
        _register_rendezvous()
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"{_SCHEME}://{host}:{port}" + (f"?fd={listener.fileno()}" if listener else ""),
            rpc_timeout=timeout,
            # Loopback TCP ("uv") for both, as the other transports use: TensorPipe would
            # otherwise pick shared memory between two processes on one host.
            _transports=["uv"],
            _channels=["basic"],
        )
        while not _inbox.empty():  # a previous link in this process may have left messages
            _inbox.get_nowait()
        saved = {k: os.environ.get(k) for k in _IFNAME_VARS}
        # TensorPipe's and gloo's listeners take the hostname's address unless told the interface.
        os.environ.update({k: "lo" for k in _IFNAME_VARS})
        try:
            with warnings.catch_warnings():  # torch's own deprecation notice about its gloo group
                warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*", category=UserWarning)
                rpc.init_rpc(self._me, rank=0 if bind else 1, world_size=2, rpc_backend_options=options)
        except RuntimeError as exc:
            if rpc.api._is_current_rpc_agent_set():  # torch leaves a half-started agent behind
                rpc.shutdown(graceful=False)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TransportTimeout(f"torch-rpc: no session with {self.peer} at {self.endpoint} "
                                   f"within {timeout:g} s: {first}") from None
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if listener is not None:
                listener.close()  # the store duplicated it (or failed)

    def _send_frames(self, frames: list[Any], timeout: float) -> None:
        header = bytes(frames[0])
        tensors = [_as_tensor(f) for f in frames[1:]]
        try:
            self._rpc.rpc_sync(self._other, _deliver, args=(header, tensors), timeout=timeout)
        except RuntimeError as exc:
            raise TransportTimeout(f"torch-rpc: could not send to {self.peer} within {timeout:g} s: {exc}") from None

    def _recv_frames(self, timeout: float) -> Sequence[Any]:
        try:
            header, *tensors = _inbox.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no message from {self.peer} within {timeout:g} s") from None
        return [header, *(memoryview(t.numpy()) for t in tensors)]

    def _close(self) -> None:
        # Graceful, so the reply to the peer's last call goes out before the agent stops;
        # bounded, because the peer may be gone (then the local agent is stopped anyway).
        rpc_log = logging.getLogger("torch.distributed.rpc.api")
        level = rpc_log.level
        rpc_log.setLevel(logging.CRITICAL)  # it logs a traceback when the peer is gone; one line below says it
        try:
            self._rpc.shutdown(graceful=True, timeout=min(self.timeout, _CLOSE_TIMEOUT_S))
        except Exception as exc:  # the peer did not take part in the shutdown
            log.info("torch-rpc: shut down without %s: %s", self.peer, str(exc).splitlines()[0])
        finally:
            rpc_log.setLevel(level)

