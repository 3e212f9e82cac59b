"""The link between the stages as the options choose it, and the check before it reaches beyond this machine."""

from __future__ import annotations

import logging

from ..settings import RunOptions, SettingsError
from ..stages import LIMITS, STAGE0, STAGE1
from ..transport import TcpTransport, Transport, ZmqTransport
from ..transport.curve import client_keys, server_keys
from ..transport.endpoints import is_local

__all__ = ["open_link", "check_exposure"]

log = logging.getLogger(__name__)


def open_link(options: RunOptions, endpoint: str, *, bind: bool, peer: str) -> Transport:
    """The link to the other stage, as chosen by ``--transport`` (and ``--curve``, ``--heartbeat``)."""
    if options.transport == "torch-rpc":
        from ..transport.torch_rpc import TorchRpcTransport  # imports torch.distributed: only when asked

        return TorchRpcTransport(endpoint, bind=bind, timeout=options.timeout, limits=LIMITS, name=peer)
    if options.transport == "tcp":
        return TcpTransport(endpoint, bind=bind, timeout=options.timeout, limits=LIMITS, name=peer,
                            heartbeat=options.heartbeat)
    keys = None
    if options.curve:
        keys = server_keys(options.curve) if bind else client_keys(options.curve, options.curve_name)
    return ZmqTransport(endpoint, bind=bind, timeout=options.timeout, limits=LIMITS, name=peer,
                        heartbeat=options.heartbeat, curve=keys)


def check_exposure(options: RunOptions, endpoint: str, *, bind: bool) -> None:
    """A link beyond this machine needs --curve, or --insecure (and then a warning): without CURVE anyone
    who reaches the ports can drive the learner and read the traffic."""
    if options.curve or is_local(endpoint):
        return
    doing = "binding" if bind else "connecting to"
    if not options.insecure:
        raise SettingsError(f"{doing} {endpoint} opens the link beyond this machine without authentication: "
                            "use --curve DIR (keys from `splitrl keys DIR`), or --insecure on a network that is "
                            "yours alone")
    log.warning("[%s] --insecure: %s %s without CURVE; anyone who reaches it can drive the learner and read the "
                "traffic", STAGE1 if bind else STAGE0, doing, endpoint)
