"""Transports: move messages (a kind, a header dict, named tensors) and count their bytes."""

from .base import ByteMeter, Transport
from .errors import PeerAbort, PeerGone, ProtocolError, TransportClosed, TransportTimeout
from .tcp_transport import TcpTransport
from .wire import PROTOCOL_VERSION, Message, WireLimits, decode, encode
from .zmq_transport import ZmqTransport, paired_endpoint

__all__ = [
    "ByteMeter",
    "Message",
    "PROTOCOL_VERSION",
    "PeerAbort",
    "PeerGone",
    "ProtocolError",
    "TcpTransport",
    "Transport",
    "TransportClosed",
    "TransportTimeout",
    "WireLimits",
    "ZmqTransport",
    "decode",
    "encode",
    "paired_endpoint",
]
