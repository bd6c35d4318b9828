"""The serving side of the sidecar port: authenticate peers, then answer their KV requests.

One thread per connection (``sendall`` from a memoryview of the staging region releases the GIL,
so connections overlap), a bounded number of them. Every way a peer can misbehave (garbage, a
wrong token, oversize or unexpected frames, vanishing mid-transfer) ends that connection only,
logged and counted; an export a connection pinned is unpinned when it goes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsv4_kvtransfer.auth import AuthError, server_handshake
from dsv4_kvtransfer.frames import (
    Frame,
    FrameError,
    FrameLimits,
    FrameType,
    PeerClosed,
    read_frame,
    send_frame,
)
from dsv4_kvtransfer.ledger import Export, LedgerError
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.staging import StagingRegion
from dsv4_kvtransfer.transports.base import TransferFailed, TransportUnavailable
from dsv4_kvtransfer.transports.collective import load_backend, open_server_channel

REQUESTS = frozenset(
    {
        FrameType.PING,
        FrameType.MANIFEST_REQ,
        FrameType.READ,
        FrameType.RELEASE,
        FrameType.SHM_MAP,
        FrameType.PG_OPEN,
        FrameType.PG_SEND,
        FrameType.RDMA_MAP,
    }
)
# every request is a small JSON object; nothing larger is read from a peer
REQUEST_META_MAX = 4096
MIN_FRAME = 4096
# send large ranges in pieces when rate-limited, so the limit is smooth
RATE_PIECE = 1 << 20


class ExportSource(Protocol):
    """What the server needs from the staging store (``store.StagingStore``; each call takes its
    lock)."""

    region: StagingRegion

    def ready_export(self, transfer_id: str) -> Export: ...
    def pin_export(self, transfer_id: str) -> Export: ...
    def unpin_export(self, transfer_id: str) -> None: ...
    def release_export(self, transfer_id: str) -> None: ...
    def rdma_session(self) -> str | None: ...


class RateLimiter:
    """Token bucket shared by all connections; ``rate`` bytes/s, 0 = unlimited."""

    def __init__(
        self,
        rate: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate = rate
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._next = clock()

    def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may go: each send starts once the previous ones' time is up."""
        if self.rate <= 0:
            return
        with self._lock:
            now = self._clock()
            start = max(self._next, now)
            self._next = start + nbytes / self.rate
        if start > now:
            self._sleep(start - now)


@dataclass(slots=True)
class PeerServerConfig:
    host: str
    port: int
    server_id: str
    token: bytes
    limits: FrameLimits = field(default_factory=FrameLimits)
    max_connections: int = 64
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 120.0
    io_timeout_s: float = 30.0
    send_rate: float = 0.0
    pg_timeout_s: float = 60.0


@dataclass(slots=True)
class _Conn:
    addr: str
    pins: collections.Counter[str] = field(default_factory=collections.Counter)
    channel: Any = None


class PeerServer:
    def __init__(
        self,
        cfg: PeerServerConfig,
        source: ExportSource,
        metrics: SidecarMetrics,
        log: logging.Logger | None = None,
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.metrics = metrics
        self.log = log or logging.getLogger("dsv4.kv.peer")
        self.rate = RateLimiter(cfg.send_rate)
        self._slots = threading.BoundedSemaphore(cfg.max_connections)
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._open: set[socket.socket] = set()
        self._workers: set[threading.Thread] = set()
        self._open_lock = threading.Lock()
        # requests carry no payload; only our own DATA frames do
        self._request_limits = FrameLimits(max_meta=REQUEST_META_MAX, max_payload=0)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        sock.listen(128)
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        self._thread.start()
        return int(sock.getsockname()[1])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
        with self._open_lock:
            for s in list(self._open):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            workers = list(self._workers)
        # let connection threads unpin and close their process groups before the process exits
        deadline = time.monotonic() + 5
        for t in workers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            if not self._slots.acquire(blocking=False):
                self.metrics.frames_rejected.labels("too_many_connections").inc()
                self.log.warning("refusing %s: %d connections open", addr, self.cfg.max_connections)
                conn.close()
                continue
            t = threading.Thread(
                target=self._serve, args=(conn, f"{addr[0]}:{addr[1]}"), daemon=True
            )
            with self._open_lock:
                self._workers.add(t)
            t.start()

    # ---- one connection --------------------------------------------------------------------

    def _serve(self, sock: socket.socket, addr: str) -> None:
        state = _Conn(addr)
        with self._open_lock:
            self._open.add(sock)
        self.metrics.connections.inc()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.cfg.handshake_timeout_s)
            peer = server_handshake(sock, self.cfg.token, self.cfg.server_id)
            self.log.debug("peer %s (%s) authenticated", addr, peer)
            while not self._stop.is_set():
                sock.settimeout(self.cfg.idle_timeout_s)
                frame = read_frame(sock, self._request_limits, REQUESTS)
                sock.settimeout(self.cfg.io_timeout_s)
                self._dispatch(sock, state, frame)
        except PeerClosed:
            self.log.debug("peer %s closed the connection", addr)
        except AuthError as e:
            self.metrics.auth_failures.inc()
            self.log.warning("refused peer %s: %s", addr, e)
        except FrameError as e:
            self.metrics.frames_rejected.labels(e.reason).inc()
            self.log.warning("refused peer %s: %s", addr, e)
            with contextlib.suppress(OSError):
                send_frame(sock, FrameType.ERROR, {"code": e.reason, "message": str(e)})
        except (TimeoutError, OSError) as e:
            self.log.info("dropped peer %s: %s", addr, e)
        except Exception:
            self.log.exception("unexpected error serving peer %s", addr)
        finally:
            for tid, n in state.pins.items():
                for _ in range(n):
                    with contextlib.suppress(LedgerError):
                        self.source.unpin_export(tid)
            if state.channel is not None:
                state.channel.close()
            with self._open_lock:
                self._open.discard(sock)
                self._workers.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                sock.close()
            self.metrics.connections.dec()
            self._slots.release()

    def _dispatch(self, sock: socket.socket, state: _Conn, frame: Frame) -> None:
        meta = frame.meta
        try:
            if frame.type == FrameType.PING:
                send_frame(sock, FrameType.PONG, {})
            elif frame.type == FrameType.MANIFEST_REQ:
                exp = self.source.ready_export(_tid(meta))
                send_frame(
                    sock,
                    FrameType.MANIFEST,
                    {
                        "transfer_id": exp.transfer_id,
                        "layout": exp.layout.to_dict(),
                        "meta": exp.meta,
                    },
                )
            elif frame.type == FrameType.READ:
                self._read(sock, meta)
            elif frame.type == FrameType.RELEASE:
                tid = _tid(meta)
                while state.pins[tid] > 0:
                    state.pins[tid] -= 1
                    self.source.unpin_export(tid)
                del state.pins[tid]
                self.source.release_export(tid)
                send_frame(sock, FrameType.RELEASED, {"transfer_id": tid})
            elif frame.type == FrameType.SHM_MAP:
                tid = _tid(meta)
                exp = self.source.pin_export(tid)
                state.pins[tid] += 1
                send_frame(
                    sock,
                    FrameType.SHM_INFO,
                    {
                        "shm_name": self.source.region.name,
                        "tag": self.source.region.tag_hex,
                        "offset": exp.offset,
                        "length": exp.layout.total_bytes,
                    },
                )
            elif frame.type == FrameType.RDMA_MAP:
                session = self.source.rdma_session()
                if session is None:
                    raise LedgerError("unsupported", "this sidecar was not started with rdma")
                tid = _tid(meta)
                exp = self.source.pin_export(tid)
                state.pins[tid] += 1
                send_frame(
                    sock,
                    FrameType.RDMA_INFO,
                    {
                        "session": session,
                        "addr": self.source.region.address(exp.offset),
                        "length": exp.layout.total_bytes,
                    },
                )
            elif frame.type == FrameType.PG_OPEN:
                self._pg_open(sock, state, meta)
            elif frame.type == FrameType.PG_SEND:
                self._pg_send(sock, state, meta)
        except LedgerError as e:
            send_frame(sock, FrameType.ERROR, {"code": e.code, "message": str(e)})

    def _range(self, meta: dict[str, Any]) -> tuple[Export, memoryview]:
        """Pin the export and return the requested range of it (caller unpins)."""
        tid = _tid(meta)
        off, length = meta.get("offset"), meta.get("length")
        if not (isinstance(off, int) and isinstance(length, int) and off >= 0 and length >= 0):
            raise LedgerError("bad_request", "offset and length must be non-negative integers")
        exp = self.source.pin_export(tid)
        if off + length > exp.layout.total_bytes:
            self.source.unpin_export(tid)
            raise LedgerError(
                "bad_request",
                f"range [{off}, {off + length}) is outside transfer {tid} "
                f"({exp.layout.total_bytes} bytes)",
            )
        return exp, self.source.region.view(exp.offset + off, length)

    def _read(self, sock: socket.socket, meta: dict[str, Any]) -> None:
        exp, view = self._range(meta)
        off = int(meta["offset"])
        step = self.cfg.limits.max_payload
        asked = meta.get("max_frame")
        if isinstance(asked, int) and not isinstance(asked, bool):
            step = min(step, max(asked, MIN_FRAME))
        if self.rate.rate > 0:
            step = min(step, RATE_PIECE)
        try:
            with view:
                for pos in range(0, len(view), step):
                    piece = view[pos : pos + step]
                    self.rate.acquire(len(piece))
                    send_frame(sock, FrameType.DATA, {"offset": off + pos}, piece)
                    self.metrics.bytes_moved.labels("sent", "tcp").inc(len(piece))
        finally:
            self.source.unpin_export(exp.transfer_id)

    def _pg_open(self, sock: socket.socket, state: _Conn, meta: dict[str, Any]) -> None:
        if state.channel is not None:
            raise LedgerError("bad_state", "this connection already has a process group")
        try:
            load_backend(str(meta.get("backend")))
        except TransportUnavailable as e:
            raise LedgerError("unsupported", str(e)) from None
        send_frame(sock, FrameType.PG_ACCEPT, {})
        try:
            state.channel = open_server_channel(meta, self.cfg.pg_timeout_s)
        except TransferFailed as e:
            raise FrameError(e.reason, str(e)) from None

    def _pg_send(self, sock: socket.socket, state: _Conn, meta: dict[str, Any]) -> None:
        if state.channel is None:
            raise LedgerError("bad_state", "PG_SEND before PG_OPEN")
        exp, view = self._range(meta)
        n = len(view)
        try:
            send_frame(sock, FrameType.PG_ACCEPT, {"length": n})
            with view:
                self.rate.acquire(n)
                state.channel.send(view, 1)
            self.metrics.bytes_moved.labels("sent", state.channel.backend).inc(n)
        finally:
            self.source.unpin_export(exp.transfer_id)
        send_frame(sock, FrameType.PG_SENT, {})


def _tid(meta: dict[str, Any]) -> str:
    tid = meta.get("transfer_id")
    if not isinstance(tid, str) or not 0 < len(tid) <= 64:
        raise LedgerError("bad_request", "transfer_id must be a string of 1-64 characters")
    return tid
