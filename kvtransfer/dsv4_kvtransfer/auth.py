"""Mutual authentication of two sidecars that share a token (mounted from a Secret).

HMAC-SHA256 challenge/response, each side proving it holds the token over both sides' fresh
nonces; the token itself never crosses the wire and a recorded exchange cannot be replayed::

    client -> HELLO     {client_nonce, client_id}
    server -> CHALLENGE {server_nonce, server_id, server_proof = H(token, "server", cn, sn)}
    client -> AUTH      {client_proof = H(token, "client", sn, cn)}    (only if server_proof is right)
    server -> AUTH_OK   or ERROR and close

Proofs are compared in constant time (``hmac.compare_digest``). The client checks the server
first, so it never hands a proof to a sidecar that cannot prove it holds the token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from pathlib import Path

from dsv4_kvtransfer.frames import (
    HANDSHAKE_LIMITS,
    FrameError,
    FrameType,
    read_frame,
    send_frame,
)

MIN_TOKEN_BYTES = 16
NONCE_BYTES = 32
_DOMAIN = b"dsv4-kv/1"


class AuthError(Exception):
    """The peer could not prove it holds the shared token (or broke the handshake)."""


def load_token(path: str | os.PathLike[str]) -> bytes:
    """The shared token from a file (surrounding whitespace ignored); refuses short tokens."""
    p = Path(path)
    try:
        token = p.read_bytes().strip()
    except OSError as e:
        raise AuthError(f"cannot read the auth token file {p}: {e.strerror or e}") from None
    if len(token) < MIN_TOKEN_BYTES:
        raise AuthError(
            f"the auth token in {p} has {len(token)} bytes; at least {MIN_TOKEN_BYTES} are required"
        )
    return token


def proof(token: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, b"|".join((_DOMAIN, role, first, second)), hashlib.sha256).digest()


def check(expected: bytes, got_hex: object) -> bool:
    """Constant-time comparison of a proof received as hex."""
    if not isinstance(got_hex, str) or len(got_hex) != 2 * len(expected):
        return False
    try:
        got = bytes.fromhex(got_hex)
    except ValueError:
        return False
    return hmac.compare_digest(expected, got)


def _nonce(meta: dict[str, object], key: str) -> bytes:
    v = meta.get(key)
    if not isinstance(v, str) or len(v) != 2 * NONCE_BYTES:
        raise AuthError(f"handshake: bad {key}")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise AuthError(f"handshake: bad {key}") from None


def client_handshake(sock: socket.socket, token: bytes, client_id: str) -> str:
    """Authenticate to a server and check that it holds the token; -> the server's id."""
    cn = secrets.token_bytes(NONCE_BYTES)
    send_frame(sock, FrameType.HELLO, {"client_nonce": cn.hex(), "client_id": client_id[:64]})
    reply = read_frame(sock, HANDSHAKE_LIMITS)
    if reply.type == FrameType.ERROR:
        raise AuthError(f"the remote sidecar refused the handshake: {reply.meta.get('message')}")
    if reply.type != FrameType.CHALLENGE:
        raise AuthError(f"handshake: expected CHALLENGE, got {reply.type.name}")
    sn = _nonce(reply.meta, "server_nonce")
    if not check(proof(token, b"server", cn, sn), reply.meta.get("server_proof")):
        raise AuthError(
            "authentication failed: the remote sidecar could not prove it holds the shared "
            "token (are both sides mounting the same kv-auth Secret?)"
        )
    send_frame(sock, FrameType.AUTH, {"client_proof": proof(token, b"client", sn, cn).hex()})
    ok = read_frame(sock, HANDSHAKE_LIMITS)
    if ok.type != FrameType.AUTH_OK:
        raise AuthError(f"authentication failed: {ok.meta.get('message', ok.type.name)}")
    return str(reply.meta.get("server_id", ""))[:64]


def server_handshake(sock: socket.socket, token: bytes, server_id: str) -> str:
    """Authenticate a connecting client; -> its id. Raises ``AuthError`` (after telling the
    client) or ``FrameError``."""
    hello = read_frame(sock, HANDSHAKE_LIMITS, frozenset({FrameType.HELLO}))
    cn = _nonce(hello.meta, "client_nonce")
    sn = secrets.token_bytes(NONCE_BYTES)
    send_frame(
        sock,
        FrameType.CHALLENGE,
        {
            "server_nonce": sn.hex(),
            "server_id": server_id[:64],
            "server_proof": proof(token, b"server", cn, sn).hex(),
        },
    )
    auth = read_frame(sock, HANDSHAKE_LIMITS, frozenset({FrameType.AUTH}))
    if not check(proof(token, b"client", sn, cn), auth.meta.get("client_proof")):
        send_frame(sock, FrameType.ERROR, {"code": "auth_failed", "message": "bad credentials"})
        raise AuthError("authentication failed: bad client proof")
    send_frame(sock, FrameType.AUTH_OK, {})
    return str(hello.meta.get("client_id", ""))[:64]


__all__ = [
    "AuthError",
    "FrameError",
    "check",
    "client_handshake",
    "load_token",
    "proof",
    "server_handshake",
]
