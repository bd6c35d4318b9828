"""The pulling side of a sidecar <-> sidecar connection: connect, authenticate, ask, receive."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from dsv4_kvtransfer.auth import client_handshake
from dsv4_kvtransfer.frames import (
    Frame,
    FrameError,
    FrameLimits,
    FrameType,
    encode,
    read_frame,
    recv_into_exact,
    send_frame,
)

# progress granularity while a large DATA payload lands
RECV_PIECE = 8 << 20
log = logging.getLogger("dsv4.kv.puller")
# RELEASEs sent without waiting whose answers are read at the latest with the next of them
MAX_OWED = 16


class RemoteError(Exception):
    """The remote sidecar answered ERROR; ``code`` is its short label."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PeerConnection:
    """One authenticated connection to a remote sidecar; requests go one at a time."""

    def __init__(
        self, sock: socket.socket, host: str, port: int, peer_id: str, limits: FrameLimits
    ) -> None:
        self.sock = sock
        self.host = host
        self.port = port
        self.peer_id = peer_id
        self.limits = limits
        # per-connection state of a transport (e.g. a process group bound to this peer)
        self.extras: dict[str, Any] = {}
        self.on_close: list[Callable[[], None]] = []
        # transfers released without waiting for the answer (read before the next reply)
        self._owed: list[str] = []

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        token: bytes,
        client_id: str,
        timeout: float = 10.0,
        limits: FrameLimits | None = None,
    ) -> PeerConnection:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer_id = client_handshake(sock, token, client_id)
        except BaseException:
            sock.close()
            raise
        return cls(sock, host, port, peer_id, limits or FrameLimits())

    def settimeout(self, seconds: float) -> None:
        self.sock.settimeout(max(seconds, 0.001))

    def close(self) -> None:
        hooks, self.on_close = self.on_close, []
        for hook in hooks:
            with contextlib.suppress(Exception):
                hook()
        self.extras.clear()
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> PeerConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settle_owed(self) -> None:
        """Read the answers owed to RELEASEs sent without waiting (an error in one logged)."""
        while self._owed:
            tid = self._owed.pop(0)
            owed = read_frame(self.sock, self.limits)
            if owed.type == FrameType.ERROR:
                log.warning(
                    "releasing transfer %s failed (its lease will free it): %s",
                    tid,
                    owed.meta.get("message"),
                )
            elif owed.type != FrameType.RELEASED:
                raise FrameError("unexpected_type", f"expected RELEASED, got {owed.type.name}")

    def _reply(self, expect: FrameType) -> Frame:
        self._settle_owed()
        frame = read_frame(self.sock, self.limits)
        if frame.type == FrameType.ERROR:
            raise RemoteError(
                str(frame.meta.get("code", "error")), str(frame.meta.get("message", ""))
            )
        if frame.type != expect:
            raise FrameError("unexpected_type", f"expected {expect.name}, got {frame.type.name}")
        return frame

    def request(self, ftype: FrameType, meta: dict[str, Any], expect: FrameType) -> dict[str, Any]:
        send_frame(self.sock, ftype, meta)
        return self._reply(expect).meta

    def reply(self, expect: FrameType) -> dict[str, Any]:
        """The answer to a request sent earlier (pipelined)."""
        return self._reply(expect).meta

    def manifest(self, transfer_id: str, pipelined: bytes = b"") -> dict[str, Any]:
        """The export's manifest. ``pipelined``: frames sent in the same write, right behind the
        request (the remote answers in order; the caller reads their replies next)."""
        self.sock.sendall(encode(FrameType.MANIFEST_REQ, {"transfer_id": transfer_id}) + pipelined)
        return self._reply(FrameType.MANIFEST).meta

    def release(self, transfer_id: str) -> None:
        self.request(FrameType.RELEASE, {"transfer_id": transfer_id}, FrameType.RELEASED)

    def release_nowait(self, transfer_id: str) -> None:
        """RELEASE without waiting for the answer: it is read (an error in it logged) before
        the next reply on this connection."""
        send_frame(self.sock, FrameType.RELEASE, {"transfer_id": transfer_id})
        self._owed.append(transfer_id)
        if len(self._owed) >= MAX_OWED:
            # a connection used only for these (in-place pulls read nothing on it) must not
            # let the answers pile up until both sides' buffers are full and the sends block
            self._settle_owed()

    def read_request(self, transfer_id: str, offset: int, length: int) -> bytes:
        """The READ frame for bytes ``[offset, offset + length)`` of the remote export (sent by
        ``read_into``, or pipelined behind another request by the caller)."""
        return encode(
            FrameType.READ,
            # the sender keeps each frame within what we accept
            {
                "transfer_id": transfer_id,
                "offset": offset,
                "length": length,
                "max_frame": self.limits.max_payload,
            },
        )

    def read_into(
        self,
        transfer_id: str,
        offset: int,
        dest: memoryview,
        progress: Callable[[int], None] = lambda n: None,
        deadline: float | None = None,
        requested: bool = False,
    ) -> None:
        """Receive bytes ``[offset, offset + len(dest))`` of the remote export into ``dest``
        (``requested``: its READ went out already, pipelined).

        The peer must send DATA frames in order, each inside the range; anything else is a
        protocol error (a broken or hostile peer cannot write outside ``dest``)."""
        length = len(dest)
        if not requested:
            self.sock.sendall(self.read_request(transfer_id, offset, length))
        pos = 0
        while pos < length:
            frame = self._reply(FrameType.DATA)
            if frame.meta.get("offset") != offset + pos:
                raise FrameError(
                    "bad_offset", f"DATA at {frame.meta.get('offset')}, expected {offset + pos}"
                )
            n = frame.payload_len
            if n == 0 or n > length - pos:
                raise FrameError("bad_length", f"DATA of {n} bytes with {length - pos} left")
            end = pos + n
            while pos < end:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("the pull ran past its deadline")
                k = min(RECV_PIECE, end - pos)
                recv_into_exact(self.sock, dest[pos : pos + k])
                pos += k
                progress(k)
