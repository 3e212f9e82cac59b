"""``tcp://HOST:PORT`` endpoints, read once for every transport.

HOST is a name, an IPv4 address, ``*`` (every interface, for binding) or an IPv6
address in brackets (``[::1]``). PORT is a number up to 65535; ZeroMQ also takes
``*`` (the wildcard port) where a transport says so. What each transport accepts
beyond that (ipc://, inproc://, loopback only) is its own business.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

__all__ = ["TcpEndpoint", "parse_tcp_endpoint", "require_tcp_endpoint", "is_local", "slot_endpoint"]

_TCP_RE = re.compile(r"tcp://(?P<host>\[[^\]]+\]|[^:/\[\]]+):(?P<port>\d+|\*)\Z")


@dataclass(frozen=True)
class TcpEndpoint:
    host: str
    """As written: an IPv6 address keeps its brackets."""
    port: int | None
    """None: the wildcard port ``*``."""

    @property
    def address(self) -> str:
        """The host for the socket API: an IPv6 address without brackets."""
        return self.host[1:-1] if self.host.startswith("[") else self.host

    def with_port(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"


def parse_tcp_endpoint(endpoint: object, *, wildcard_port: bool = False) -> TcpEndpoint | None:
    """The parts of a ``tcp://HOST:PORT`` endpoint, or None if ``endpoint`` is not one.

    The wildcard port ``*`` counts only with ``wildcard_port``; a port beyond 65535 is a `ValueError`.
    """
    m = _TCP_RE.match(endpoint) if isinstance(endpoint, str) else None
    if not m:
        return None
    if m["port"] == "*":
        if not wildcard_port:
            return None
        return TcpEndpoint(m["host"], None)
    port = int(m["port"])
    if port > 65535:
        raise ValueError(f"{endpoint}: port {port} is out of range")
    return TcpEndpoint(m["host"], port)


def require_tcp_endpoint(endpoint: object, transport: str) -> TcpEndpoint:
    """`parse_tcp_endpoint` for a transport that speaks tcp only: anything else is a `ValueError` naming it."""
    tcp = parse_tcp_endpoint(endpoint)
    if tcp is None:
        raise ValueError(f"{transport} needs a tcp://HOST:PORT endpoint, got {endpoint!r}")
    return tcp


def is_local(endpoint: str) -> bool:
    """Whether ``endpoint`` stays on this machine: ipc:// and inproc://, or a tcp host that is a loopback
    address or a name resolving only to loopback addresses. Wildcards (``*``, 0.0.0.0, ::) are not local."""
    tcp = parse_tcp_endpoint(endpoint, wildcard_port=True)
    if tcp is None:
        return endpoint.startswith(("ipc://", "inproc://"))
    if tcp.address == "*":
        return False
    try:
        infos = socket.getaddrinfo(tcp.address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def slot_endpoint(endpoint: str, slot: int) -> str:
    """Where edge ``slot`` of a fleet meets stage1: ``tcp://HOST:PORT + 2 x slot`` (each edge a port pair), or
    ``-slot`` appended to an ipc:// or inproc:// name; slot 0 is ``endpoint`` itself."""
    if slot == 0:
        return endpoint
    tcp = parse_tcp_endpoint(endpoint)
    if tcp is not None:
        if tcp.port == 0 or tcp.port + 2 * slot + 1 > 65535:
            raise ValueError(f"{endpoint}: a fleet's edge {slot} needs port {tcp.port} + {2 * slot} and the one "
                             "after it (a fixed port, the fleet's ports in range)")
        return tcp.with_port(tcp.port + 2 * slot)
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}-{slot}"
    raise ValueError(f"unsupported endpoint {endpoint!r} for a fleet: use tcp://HOST:PORT or ipc://PATH")
