"""ZeroMQ CURVE: the link encrypted, stage0 authenticated by its key, stage1 by the key stage0 pins.

A key directory (``splitrl keys DIR``) holds::

    stage1.key            stage1's public key: stage0 connects only to the server holding its secret
    stage1.key_secret     stage1's key pair (keep it on the server)
    stage0.key_secret     an edge's key pair (keep it on the edge); more edges: ``--name edge2``
    authorized/*.key      the edges' public keys: stage1 accepts these and no others

The files are pyzmq's certificate format (`zmq.auth.certs`); secrets are written mode 0600.
Authentication is libzmq's ZAP, answered by `splitrl.transport.gate.Gate`: a peer whose key is
not in ``authorized/`` is refused during the CURVE handshake, before any of its frames reaches
splitrl's decoder, and the refusal is logged and counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from ..errors import SettingsError

__all__ = ["CurveKeys", "make_keys", "server_keys", "client_keys", "SERVER_NAME", "AUTHORIZED"]

SERVER_NAME = "stage1"
AUTHORIZED = "authorized"


@dataclass(frozen=True)
class CurveKeys:
    """One side's CURVE keys (z85 bytes): its own pair, and the server's public key (client side) or
    the clients' public keys it accepts (server side)."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None
    authorized: frozenset[bytes] = field(default_factory=frozenset)
    source: str = ""

    @property
    def is_server(self) -> bool:
        return self.server_public is None


def make_keys(directory: str | Path, name: str = "stage0") -> list[Path]:
    """Create stage1's key pair (unless the directory has one) and an edge key pair called ``name``, whose
    public key goes into ``authorized/``. Returns the files written. Existing keys are never overwritten."""
    if not name or name == SERVER_NAME or not name.replace("-", "").replace("_", "").isalnum():
        raise SettingsError(f"key name {name!r}: use letters, digits, - and _ (and not {SERVER_NAME!r})")
    root = Path(directory)
    (root / AUTHORIZED).mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if not (root / f"{SERVER_NAME}.key_secret").exists():
        written += _pair(root, SERVER_NAME)
    if (root / f"{name}.key_secret").exists():
        raise SettingsError(f"{root / (name + '.key_secret')} exists already: pick another --name or delete it")
    written += _pair(root, name)
    target = root / AUTHORIZED / f"{name}.key"
    (root / f"{name}.key").replace(target)  # only the server needs an edge's public key
    return [target if p == root / f"{name}.key" else p for p in written]


def _pair(root: Path, name: str) -> list[Path]:
    public, secret = (Path(p) for p in zmq.auth.create_certificates(root, name))
    os.chmod(secret, 0o600)
    return [public, secret]


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SettingsError(f"--curve: cannot read {path}: {exc} (make keys with `splitrl keys DIR`)") from None
    if secret and not secret_key:
        raise SettingsError(f"--curve: {path} holds no secret key")
    return public, secret_key


def server_keys(directory: str | Path) -> CurveKeys:
    """Stage1's keys: its pair and the edges it accepts."""
    root = Path(directory)
    public, secret = _load(root / f"{SERVER_NAME}.key_secret", secret=True)
    accepted = root / AUTHORIZED
    keys = frozenset(_load(p, secret=False)[0] for p in sorted(accepted.glob("*.key"))) if accepted.is_dir() else frozenset()
    if not keys:
        raise SettingsError(f"--curve {directory}: no edge keys in {accepted} (add one with `splitrl keys {directory}`)")
    return CurveKeys(public=public, secret=secret or b"", authorized=keys, source=str(root))


def client_keys(directory: str | Path, name: str = "stage0") -> CurveKeys:
    """An edge's keys: its pair and stage1's public key, which it pins."""
    root = Path(directory)
    public, secret = _load(root / f"{name}.key_secret", secret=True)
    server, _ = _load(root / f"{SERVER_NAME}.key", secret=False)
    return CurveKeys(public=public, secret=secret or b"", server_public=server, source=str(root))


def apply(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE server or client before it binds or connects."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    if keys.is_server:
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys.server_public
