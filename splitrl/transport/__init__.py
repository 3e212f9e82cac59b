"""Transports: move messages (a kind, a header dict, named tensors) and count their bytes.

The names below load with their modules on first use (PEP 562), so what needs only `curve` (``splitrl keys``) or
the errors does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import PeerAbort, PeerGone, ProtocolError, TransportClosed, TransportTimeout

if TYPE_CHECKING:
    from .base import ByteMeter, Transport
    from .tcp_transport import TcpTransport
    from .wire import PROTOCOL_VERSION, Message, WireLimits, decode, encode
    from .zmq_transport import ZmqTransport, paired_endpoint

_LAZY = {
    "ByteMeter": "base", "Transport": "base", "TcpTransport": "tcp_transport", "PROTOCOL_VERSION": "wire",
    "Message": "wire", "WireLimits": "wire", "decode": "wire", "encode": "wire", "ZmqTransport": "zmq_transport",
    "paired_endpoint": "zmq_transport",
}

__all__ = sorted([*_LAZY, "PeerAbort", "PeerGone", "ProtocolError", "TransportClosed", "TransportTimeout"])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
