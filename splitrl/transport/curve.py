"""ZeroMQ CURVE: the link encrypted, stage0 authenticated by its key, stage1 by the key stage0 pins.

A key directory (``splitrl keys DIR``) holds::

    stage1.key            stage1's public key: stage0 connects only to the server holding its secret
    stage1.key_secret     stage1's key pair (keep it on the server)
    stage0.key_secret     an edge's key pair (keep it on the edge); more edges: ``--name edge2``
    authorized/*.key      the edges' public keys: stage1 accepts these and no others

The files are pyzmq's certificate format (`zmq.auth.certs`, read by `zmq.auth.load_certificate`). A secret
file is created mode 0600 (``O_CREAT | O_EXCL``: it is never readable by others, whatever the umask), and one
whose mode lets group or others at it is refused when loaded, as SSH refuses a private key with loose modes.
Authentication is libzmq's ZAP, answered by `splitrl.transport.gate.Gate`: a peer whose key is
not in ``authorized/`` is refused during the CURVE handshake, before any of its frames reaches
splitrl's decoder, and the refusal is logged and counted.
"""

from __future__ import annotations

import os
import stat
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


_SECRET_BANNER = """#   ZeroMQ CURVE **Secret** Certificate
#   Keep it on the machine that uses it, mode 0600: splitrl refuses it when others may read it.

"""

_PUBLIC_BANNER = """#   ZeroMQ CURVE Public Certificate
#   Exchange securely, or verify the contents of this file after exchange.

"""


def make_keys(directory: str | Path, name: str = "stage0") -> list[Path]:
    """Create stage1's key pair (unless the directory has one) and an edge key pair called ``name``, whose
    public key goes into ``authorized/``. Returns the files written. Existing secrets are never overwritten."""
    if not name or name == SERVER_NAME or not name.replace("-", "").replace("_", "").isalnum():
        raise SettingsError(f"key name {name!r}: use letters, digits, - and _ (and not {SERVER_NAME!r})")
    root = Path(directory)
    (root / AUTHORIZED).mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if not (root / f"{SERVER_NAME}.key_secret").exists():
        written += _pair(root / f"{SERVER_NAME}.key_secret", root / f"{SERVER_NAME}.key")
    # Only the server needs an edge's public key.
    written += _pair(root / f"{name}.key_secret", root / AUTHORIZED / f"{name}.key")
    return written


def _pair(secret_path: Path, public_path: Path) -> list[Path]:
    """A fresh key pair from `zmq.curve_keypair`: the secret file created 0600 (never there with a wider mode, and
    never over an existing one), then the public file. Returns [public, secret]."""
    public, secret = zmq.curve_keypair()
    try:  # O_EXCL: a new file (never an existing one, nor through a link), created with the mode given
        fd = os.open(secret_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        raise SettingsError(f"{secret_path} exists already: pick another --name or delete it") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(_certificate(_SECRET_BANNER, public, secret))
    fd = os.open(public_path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(_certificate(_PUBLIC_BANNER, public))
    return [public_path, secret_path]


def _certificate(banner: str, public: bytes, secret: bytes | None = None) -> str:
    """pyzmq's certificate format (what `zmq.auth.create_certificates` writes, without its date)."""
    lines = [banner, "metadata\n", "curve\n", f'    public-key = "{public.decode("ascii")}"\n']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"\n')
    return "".join(lines)


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if secret:
        _check_private(path)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SettingsError(f"--curve: cannot read {path}: {exc} (make keys with `splitrl keys DIR`)") from None
    if secret and not secret_key:
        raise SettingsError(f"--curve: {path} holds no secret key")
    return public, secret_key


def _check_private(path: Path) -> None:
    """Refuse a secret key file that group or others may read, write or run (mode & 0o077)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return  # a missing or unreadable file: `_load` says so
    if mode & 0o077:
        raise SettingsError(f"--curve: {path} holds a secret key but has mode {mode:04o}, open to others; "
                            f"run `chmod 600 {path}` (splitrl keys writes it so)")


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
