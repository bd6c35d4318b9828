from __future__ import annotations

import socket
import struct
import threading

import pytest

from dsv4_kvtransfer.frames import (
    HANDSHAKE_LIMITS,
    PREFIX_SIZE,
    FrameError,
    FrameLimits,
    FrameType,
    PeerClosed,
    encode,
    parse_prefix,
    read_frame,
    send_frame,
)
from dsv4_kvtransfer.peer import PeerConnection


def test_encoding_is_the_documented_layout() -> None:
    raw = encode(FrameType.READ, {"a": 1}, payload_len=0)
    assert PREFIX_SIZE == 20
    assert raw == b"DSKV" + bytes([1, 12]) + b"\x00\x00" + struct.pack("!IQ", 7, 0) + b'{"a":1}'
    assert parse_prefix(raw[:20], FrameLimits()) == (FrameType.READ, 0, 7, 0)
    data = encode(FrameType.DATA, {"offset": 0}, payload_len=5)
    assert parse_prefix(data[:20], FrameLimits(max_payload=5))[3] == 5


def _prefix(
    magic: bytes = b"DSKV", version: int = 1, ftype: int = 1, meta: int = 0, payload: int = 0
) -> bytes:
    return struct.pack("!4sBBHIQ", magic, version, ftype, 0, meta, payload)


@pytest.mark.parametrize(
    ("prefix", "limits", "reason"),
    [
        (_prefix(magic=b"HTTP"), FrameLimits(), "bad_magic"),
        (_prefix(version=2), FrameLimits(), "bad_version"),
        (_prefix(ftype=99), FrameLimits(), "unknown_type"),
        (_prefix(meta=1025), HANDSHAKE_LIMITS, "meta_too_large"),
        (_prefix(ftype=int(FrameType.DATA), payload=1), HANDSHAKE_LIMITS, "payload_too_large"),
        (_prefix(ftype=int(FrameType.READ), payload=1), FrameLimits(), "unexpected_payload"),
        (
            _prefix(ftype=int(FrameType.DATA), payload=(64 << 20) + 1),
            FrameLimits(max_payload=64 << 20),
            "payload_too_large",
        ),
        (b"DSKV", FrameLimits(), "short_prefix"),
    ],
)
def test_bad_prefixes_are_refused_before_anything_is_read(
    prefix: bytes, limits: FrameLimits, reason: str
) -> None:
    with pytest.raises(FrameError) as e:
        parse_prefix(prefix, limits)
    assert e.value.reason == reason


def test_only_allowed_types_pass() -> None:
    with pytest.raises(FrameError) as e:
        parse_prefix(
            _prefix(ftype=int(FrameType.READ)), FrameLimits(), frozenset({FrameType.HELLO})
        )
    assert e.value.reason == "unexpected_type"


def test_read_frame_over_a_socket_and_bad_meta() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, FrameType.MANIFEST_REQ, {"transfer_id": "t"})
        f = read_frame(b, FrameLimits())
        assert (f.type, f.meta, f.payload_len) == (FrameType.MANIFEST_REQ, {"transfer_id": "t"}, 0)
        a.sendall(_prefix(ftype=int(FrameType.PING), meta=3) + b"[1]")
        with pytest.raises(FrameError, match="JSON object"):
            read_frame(b, FrameLimits())
        a.sendall(_prefix(ftype=int(FrameType.PING), meta=2) + b"\xff\xfe")
        with pytest.raises(FrameError, match="not JSON"):
            read_frame(b, FrameLimits())
        a.close()
        with pytest.raises(PeerClosed):
            read_frame(b, FrameLimits())


def _fake_server(sock: socket.socket, frames: list[tuple[dict[str, object], bytes]]) -> None:
    read_frame(sock, FrameLimits())  # the READ
    for meta, payload in frames:
        sock.sendall(encode(FrameType.DATA, meta, len(payload)) + payload)


def _read_from(
    frames: list[tuple[dict[str, object], bytes]], n: int, limits: FrameLimits
) -> bytearray:
    a, b = socket.socketpair()
    dest = bytearray(n)
    t = threading.Thread(target=_fake_server, args=(b, frames))
    t.start()
    try:
        PeerConnection(a, "x", 0, "peer", limits).read_into("t", 100, memoryview(dest))
    finally:
        t.join()
        a.close()
        b.close()
    return dest


def test_data_lands_in_place_and_a_hostile_sender_cannot_write_outside() -> None:
    got = _read_from([({"offset": 100}, b"abc"), ({"offset": 103}, b"de")], 5, FrameLimits())
    assert bytes(got) == b"abcde"
    with pytest.raises(FrameError) as e:  # a frame beyond the requested range
        _read_from([({"offset": 100}, b"abcdef")], 5, FrameLimits())
    assert e.value.reason == "bad_length"
    with pytest.raises(FrameError) as e:  # out of order
        _read_from([({"offset": 101}, b"abc")], 5, FrameLimits())
    assert e.value.reason == "bad_offset"
    with pytest.raises(FrameError) as e:  # over the receiver's frame limit
        _read_from([({"offset": 100}, b"abcde")], 5, FrameLimits(max_payload=4))
    assert e.value.reason == "payload_too_large"
