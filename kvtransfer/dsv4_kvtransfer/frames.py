"""Sidecar <-> sidecar wire format: length-prefixed frames with a bounded header and payload.

A frame is a fixed 20-byte prefix, a JSON object (``meta``) and a raw payload::

    magic "DSKV" | version u8 | type u8 | flags u16 | meta_len u32 | payload_len u64   (network order)

Limits are checked on the prefix, before anything else is read or allocated, so a peer can never
make the sidecar buffer more than ``max_meta`` bytes or accept a payload it did not ask for. Only
``DATA`` frames carry a payload; the receiver reads it straight into its staging region
(``recv_into`` on a memoryview: no intermediate copy).
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

MAGIC = b"DSKV"
VERSION = 1
PREFIX = struct.Struct("!4sBBHIQ")
PREFIX_SIZE = PREFIX.size  # 20


class FrameType(IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    AUTH_OK = 4
    ERROR = 5
    PING = 6
    PONG = 7
    MANIFEST_REQ = 10
    MANIFEST = 11
    READ = 12
    DATA = 13
    RELEASE = 14
    RELEASED = 15
    SHM_MAP = 16
    SHM_INFO = 17
    PG_OPEN = 18
    PG_ACCEPT = 19
    PG_SEND = 20
    PG_SENT = 21
    RDMA_MAP = 22
    RDMA_INFO = 23


HANDSHAKE_TYPES = frozenset({FrameType.HELLO, FrameType.CHALLENGE, FrameType.AUTH})
PAYLOAD_TYPES = frozenset({FrameType.DATA})


@dataclass(frozen=True, slots=True)
class FrameLimits:
    max_meta: int = 1 << 20
    """Largest JSON header accepted (bytes); a manifest of a few hundred buffers is ~30 KiB."""
    max_payload: int = 64 << 20
    """Largest payload of one frame (bytes); larger transfers span several frames."""


# before authentication a peer may send only small handshake frames
HANDSHAKE_LIMITS = FrameLimits(max_meta=1024, max_payload=0)


class FrameError(Exception):
    """A frame that breaks the protocol; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PeerClosed(ConnectionError):
    """The peer closed the connection (cleanly, between or inside a frame)."""


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    meta: dict[str, Any]
    payload_len: int
    flags: int = 0


# one encoder for every frame: ``json.dumps`` with separators builds a new one per call
# (~20 us, a good part of a small pull's bookkeeping)
_encode_json = json.JSONEncoder(separators=(",", ":")).encode


def encode(ftype: FrameType, meta: dict[str, Any] | None = None, payload_len: int = 0) -> bytes:
    """Prefix + meta of a frame (the payload, if any, is sent after it by the caller)."""
    body = _encode_json(meta or {}).encode()
    return PREFIX.pack(MAGIC, VERSION, int(ftype), 0, len(body), payload_len) + body


def parse_prefix(
    prefix: bytes, limits: FrameLimits, allowed: frozenset[FrameType] | None = None
) -> tuple[FrameType, int, int, int]:
    """Check a frame prefix against the protocol and ``limits``; -> (type, flags, meta_len,
    payload_len)."""
    if len(prefix) != PREFIX_SIZE:
        raise FrameError("short_prefix", f"frame prefix of {len(prefix)} bytes")
    magic, version, ftype, flags, meta_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError("bad_magic", f"not a dsv4 KV frame (magic {magic!r})")
    if version != VERSION:
        raise FrameError(
            "bad_version", f"protocol version {version} is not supported (this side speaks 1)"
        )
    try:
        t = FrameType(ftype)
    except ValueError:
        raise FrameError("unknown_type", f"unknown frame type {ftype}") from None
    if allowed is not None and t not in allowed:
        raise FrameError("unexpected_type", f"frame {t.name} is not allowed here")
    if meta_len > limits.max_meta:
        raise FrameError("meta_too_large", f"frame header of {meta_len} bytes > {limits.max_meta}")
    if payload_len and t not in PAYLOAD_TYPES:
        raise FrameError("unexpected_payload", f"frame {t.name} cannot carry a payload")
    if payload_len > limits.max_payload:
        raise FrameError(
            "payload_too_large", f"frame payload of {payload_len} bytes > {limits.max_payload}"
        )
    return t, flags, meta_len, payload_len


def parse_meta(raw: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise FrameError("bad_meta", f"frame header is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise FrameError("bad_meta", "frame header must be a JSON object")
    return meta


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (zero-copy into the caller's memory)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerClosed(f"peer closed the connection after {got} of {n} bytes")
        got += k


def read_frame(
    sock: socket.socket, limits: FrameLimits, allowed: frozenset[FrameType] | None = None
) -> Frame:
    """Read one frame's prefix and meta; the payload (``payload_len`` bytes) is left on the socket
    for the caller to read into its destination."""
    first = sock.recv(PREFIX_SIZE)
    if not first:
        raise PeerClosed("peer closed the connection")
    prefix = (
        first if len(first) == PREFIX_SIZE else first + recv_exact(sock, PREFIX_SIZE - len(first))
    )
    ftype, flags, meta_len, payload_len = parse_prefix(prefix, limits, allowed)
    meta = parse_meta(recv_exact(sock, meta_len)) if meta_len else {}
    return Frame(ftype, meta, payload_len, flags)


def send_frame(
    sock: socket.socket,
    ftype: FrameType,
    meta: dict[str, Any] | None = None,
    payload: memoryview | bytes | None = None,
) -> None:
    n = len(payload) if payload is not None else 0
    sock.sendall(encode(ftype, meta, n))
    if payload is not None and n:
        sock.sendall(payload)


def discard(sock: socket.socket, n: int, chunk: int = 1 << 20) -> None:
    """Drain ``n`` payload bytes we do not want (keeps the stream in sync)."""
    buf = memoryview(bytearray(min(n, chunk) or 1))
    while n > 0:
        k = min(n, len(buf))
        recv_into_exact(sock, buf[:k])
        n -= k
