"""Transports: move messages (a kind, a header dict, named tensors) and count their bytes.

The names below load with their modules on first use (PEP 562), so what needs only `curve` (``splitrl keys``) or
the errors does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_getattr
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

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
