"""Pulls on behalf of the decode engine: one worker per pull, a small pool of peer connections.

A pull: connect (or reuse a pooled connection) -> MANIFEST (with the transport's data request
in the same write) -> reserve an extent of that size -> the transport lands the bytes ->
``done`` -> RELEASE (the prefill side frees its export): the extent waits, under a lease, for
the engine to copy the KV out and release it. Any failure frees
our extent and leaves the pull ``failed`` with a reason; the remote export stays leased, so a
retry (or the lease) settles it.

Where the transport can read the export in place (shm on one host: ``direct_source``), the
pull first tries that without any round trip: the manifest from the export's trailer, the
copy, the trailer checked intact; only RELEASE goes to the peer, after the pull is ``done``.
If the export is not readable so (gone, retired meanwhile), the pull asks the peer as above.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from dsv4_kvtransfer.auth import AuthError
from dsv4_kvtransfer.buffers import Layout, LayoutCache, LayoutError
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.control_requests import PullRequest
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.frames import FrameError, FrameLimits, PeerClosed
from dsv4_kvtransfer.integrity import (
    Fingerprint,
    IntegrityError,
    IntegrityRecord,
    check_fingerprint,
)
from dsv4_kvtransfer.kv_spans import SidecarSpans
from dsv4_kvtransfer.ledger import LedgerError
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_kvtransfer.peer import PeerConnection, RemoteError
from dsv4_kvtransfer.store import StagingStore, wall_time
from dsv4_kvtransfer.transports import FetchJob, TransferFailed, Transport

PullState = Literal["pending", "done", "failed", "expired"]
POOL_IDLE_S = 20.0
POOL_PER_PEER = 2
# pulls up to this size asked with a wait run on the asking thread (see ``start``)
INLINE_PULL_BYTES = 64 << 20


@dataclass(slots=True)
class Pull:
    pull_id: str
    params: RemotePrefillParams
    deadline: float
    created: float = field(default_factory=time.monotonic)
    state: PullState = "pending"
    error: str | None = None
    reason: str | None = None
    bytes_done: int = 0
    total_bytes: int = 0
    offset: int | None = None
    layout: Layout | None = None
    remote_meta: dict[str, Any] = field(default_factory=dict)
    expires_at: float | None = None
    cancelled: bool = False
    finished: float | None = None
    traceparent: str | None = None  # tracing on: the engine's pull span
    started_ns: int = 0
    timing: tuple[float, float] = (0.0, 0.0)  # a landed pull's start and data seconds
    peer: PeerConnection | None = None  # a landed pull's connection, until RELEASE went out
    expect: Fingerprint | None = None  # the puller's KV layout (None: any)


def classify(e: BaseException) -> str:
    """A short, bounded label for the failure metric."""
    if isinstance(e, AuthError):
        return "auth"
    if isinstance(e, IntegrityError):
        return e.reason
    if isinstance(e, RemoteError):
        return e.code if e.code in ("unknown_transfer", "auth_failed", "unsupported") else "remote"
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, FrameError | LayoutError):
        return "protocol"
    if isinstance(e, TransferFailed):
        return e.reason
    if isinstance(e, LedgerError):
        return e.code
    if isinstance(e, PeerClosed | ConnectionError):
        return "connection"
    if isinstance(e, OSError):
        return "connection"
    return "internal"


class Puller:
    """The decode side's pulls. Its own lock guards ``pulls``; extents go through the store
    (whose lock is only ever taken inside this one, never the other way round)."""

    def __init__(
        self,
        store: StagingStore,
        transport: Transport,
        cfg: SidecarConfig,
        metrics: SidecarMetrics,
        log: logging.Logger | None = None,
    ) -> None:
        self.store = store
        self.transport = transport
        self.cfg = cfg
        self.metrics = metrics
        self.log = log or logging.getLogger("dsv4.kv.puller")
        self.limits = FrameLimits(max_payload=cfg.max_frame_bytes)
        self.pulls: dict[str, Pull] = {}
        self._cond = threading.Condition()
        self._pool: dict[tuple[str, int], list[tuple[float, PeerConnection]]] = {}
        self._pool_lock = threading.Lock()
        self._exec = ThreadPoolExecutor(self.cfg.max_concurrent_pulls, thread_name_prefix="kv-pull")
        # pulls running at once, on the pool or inline (``start``)
        self._slots = threading.BoundedSemaphore(self.cfg.max_concurrent_pulls)
        self.spans: SidecarSpans | None = None
        self._layouts = LayoutCache()  # in-place pulls' trailers

    def stop(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)
        with self._pool_lock:
            for conns in self._pool.values():
                for _, c in conns:
                    c.close()
            self._pool.clear()

    def count(self) -> int:
        with self._cond:
            return len(self.pulls)

    # ---- engine API -------------------------------------------------------------------------

    def start(
        self,
        req: PullRequest,
        traceparent: str | None = None,
        after: list[Callable[[], None]] | None = None,
    ) -> dict[str, Any]:
        """Start a pull (see ``PullRequest``). ``after``: where to leave what should run once
        the answer went out (an inline pull's metrics and RELEASE), instead of starting it now
        and competing with the answer for the CPU."""
        timeout = req.timeout_s or self.cfg.pull_timeout_s
        pull = Pull(secrets.token_hex(12), req.params, time.monotonic() + timeout)
        pull.expect = req.fingerprint
        if self.spans is not None:
            pull.traceparent, pull.started_ns = traceparent, time.time_ns()
        pull.total_bytes = req.params.remote_total_bytes
        with self._cond:
            self.pulls[pull.pull_id] = pull
        # the engine waits for the answer anyway: a small pull runs on this thread, with no
        # hand-off to a worker and back (two thread wake-ups, a good part of its fixed cost)
        inline = 0 < pull.total_bytes <= INLINE_PULL_BYTES and req.wait_s > 0
        if inline and self._slots.acquire(blocking=False):
            try:
                landed = self._run(pull)
            finally:
                self._slots.release()
            if landed:  # after the answer, not before: off the engine's path
                if after is None:
                    self._exec.submit(self._landed, pull)
                else:
                    after.append(lambda: self._answered(pull))
            return self.status(pull.pull_id)
        self._exec.submit(self._queued, pull)
        return self.status(pull.pull_id, req.wait_s)

    def _answered(self, pull: Pull) -> None:
        """An inline pull's answer went out; on the same thread (no other one to wake): the
        metrics, then RELEASE on a pooled connection without waiting for its answer. Without
        one (its handshake would hold this connection's next request), on the pool."""
        self._record(pull)
        p = pull.params
        conn, pull.peer = pull.peer, None
        conn = conn or self._pooled(p.remote_host, p.remote_port)
        if conn is not None:
            try:
                conn.release_nowait(p.remote_transfer_id)
            except OSError:  # gone stale: a fresh one, on the pool
                conn.close()
            else:
                self._give_back(conn)
                return
        self._exec.submit(self._release_remote, pull)

    def adopt(
        self,
        grant_id: str,
        params: RemotePrefillParams,
        manifest: bytes,
        timing: tuple[float, float],
        traceparent: str | None = None,
    ) -> Callable[[], None]:
        """A same-host pull the engine's client made itself, into the extent granted to it
        (``StagingStore.grant``; the pull id is the grant's): from now on a landed pull like
        any other. ``manifest``: the export's, from its trailer. -> what to run once the answer
        went out (the metrics, RELEASE to the peer). ``timing``: the client's seconds for the
        whole pull and for its copy. ``ValueError`` (the grant unchanged) if it does not add
        up."""
        raw_layout, _, raw_meta = manifest.partition(b"\n")
        layout = self._layouts.get(raw_layout)
        meta = json.loads(raw_meta)
        if layout.total_bytes != params.remote_total_bytes or not isinstance(meta, dict):
            raise ValueError("the adopted pull's manifest does not match its size")
        n = layout.total_bytes
        pull = Pull(grant_id, params, time.monotonic(), total_bytes=n, bytes_done=n)
        with self._cond:
            pull.offset, pull.expires_at = self.store.adopt(grant_id, n, self.cfg.lease_seconds)
            pull.layout, pull.remote_meta = layout, meta
            pull.state, pull.finished = "done", time.monotonic()
            pull.timing = (pull.finished - timing[0], max(timing[1], 1e-9))
            self.pulls[grant_id] = pull
            self._cond.notify_all()
        self.metrics.adopted.inc()
        if self.spans is not None:
            started = time.time_ns() - int(timing[0] * 1e9)
            remote = f"{params.remote_host}:{params.remote_port}"
            self.spans.transfer(traceparent, started, n, pull.timing[1], remote)
        return lambda: self._answered(pull)

    def _queued(self, pull: Pull) -> None:
        with self._slots:
            landed = self._run(pull)
        if landed:
            self._landed(pull)

    def _landed(self, pull: Pull) -> None:
        """After a pull landed (and, inline, after its answer): the metrics record it, then the
        remote frees its export."""
        self._record(pull)
        self._release_remote(pull)

    def status(self, pull_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        end = time.monotonic() + max(0.0, min(wait_s, 60.0))
        with self._cond:
            pull = self.pulls.get(pull_id)
            if pull is None:
                raise ApiError(404, "unknown_pull", f"unknown pull {pull_id}")
            while pull.state == "pending":
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._status(pull)

    def release(self, pull_id: str) -> dict[str, Any]:
        """The engine is done with the pulled KV (or gives up on a pending pull)."""
        with self._cond:
            pull = self.pulls.get(pull_id)
            if pull is None:
                raise ApiError(404, "unknown_pull", f"unknown pull {pull_id}")
            if pull.state == "pending":
                pull.cancelled = True  # the worker frees the extent when it stops
                freed = False
            else:
                freed = self.store.drop_import(pull_id, "pulled")
                del self.pulls[pull_id]
        return {"pull_id": pull_id, "freed": freed}

    def _status(self, pull: Pull) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pull_id": pull.pull_id,
            "state": pull.state,
            "bytes_done": pull.bytes_done,
            "total_bytes": pull.total_bytes,
            "remote_transfer_id": pull.params.remote_transfer_id,
        }
        if pull.error:
            out["error"] = pull.error
            out["reason"] = pull.reason
        if pull.state == "done" and pull.layout is not None and pull.offset is not None:
            out["shm_name"] = self.store.region.name
            out["shm_tag"] = self.store.region.tag_hex
            out["offset"] = pull.offset
            out["buffers"] = [
                {**b.to_dict(), "offset": pull.offset + b.offset} for b in pull.layout.buffers
            ]
            out["remote_meta"] = pull.remote_meta
            if pull.expires_at is not None:
                out["lease_expires_at"] = wall_time(pull.expires_at)
        return out

    # ---- housekeeping (called by the sidecar's sweeper) --------------------------------------

    def on_expired(self, pull_ids: list[str]) -> None:
        with self._cond:
            for pid in pull_ids:
                pull = self.pulls.get(pid)
                if pull is not None:
                    pull.state = "expired"
                    pull.error = "the engine did not release the pulled KV within the lease"
                    pull.reason = "expired"
                    pull.finished = time.monotonic()
            self._cond.notify_all()

    def prune(self) -> None:
        """Forget failed and expired pulls the engine never asked about again."""
        now = time.monotonic()
        with self._cond:
            for pid, p in list(self.pulls.items()):
                if p.state in ("failed", "expired") and now - (p.finished or now) > max(
                    self.cfg.lease_seconds, 5.0
                ):
                    del self.pulls[pid]
        with self._pool_lock:
            for key, conns in list(self._pool.items()):
                keep = [(t, c) for t, c in conns if now - t < POOL_IDLE_S]
                for t, c in conns:
                    if now - t >= POOL_IDLE_S:
                        c.close()
                self._pool[key] = keep

    # ---- connections -------------------------------------------------------------------------

    def _connect(self, host: str, port: int) -> PeerConnection:
        return PeerConnection.open(
            host,
            port,
            self.cfg.token,
            self.cfg.sidecar_id,
            timeout=self.cfg.connect_timeout_s,
            limits=self.limits,
        )

    def _pooled(self, host: str, port: int) -> PeerConnection | None:
        now = time.monotonic()
        with self._pool_lock:
            conns = self._pool.get((host, port), [])
            while conns:
                t, c = conns.pop()
                if now - t < POOL_IDLE_S:
                    return c
                c.close()
        return None

    def _give_back(self, conn: PeerConnection) -> None:
        with self._pool_lock:
            conns = self._pool.setdefault((conn.host, conn.port), [])
            if len(conns) < POOL_PER_PEER:
                conns.append((time.monotonic(), conn))
                return
        conn.close()

    def _manifest(self, pull: Pull) -> tuple[PeerConnection, dict[str, Any], bool]:
        """The remote manifest over a pooled connection, or a fresh one if the pooled one went
        stale (the remote restarted or timed it out). The transport's data request goes out in
        the same write (the remote answers in order): a pull costs one round trip before the
        bytes flow, not two. -> (connection, manifest, whether the data request went out)."""
        p = pull.params
        data = b""

        def ask(conn: PeerConnection) -> dict[str, Any]:
            nonlocal data
            # bounded by the pull's deadline too: an inline pull answers its caller by then
            conn.settimeout(min(self.cfg.io_timeout_s, pull.deadline - time.monotonic()))
            data = self.transport.pipelined_request(
                conn, p.remote_transfer_id, p.remote_total_bytes
            )
            return conn.manifest(p.remote_transfer_id, data)

        conn = self._pooled(p.remote_host, p.remote_port)
        if conn is not None:
            try:
                return conn, ask(conn), bool(data)
            except (OSError, FrameError):
                conn.close()
        conn = self._connect(p.remote_host, p.remote_port)
        try:
            return conn, ask(conn), bool(data)
        except BaseException:
            conn.close()
            raise

    # ---- one pull ----------------------------------------------------------------------------

    def _progress(self, pull: Pull, n: int) -> None:
        with self._cond:
            pull.bytes_done += n

    def _run(self, pull: Pull) -> bool:
        """Land the pull; -> whether it landed (then ``pull.peer``, if set, is the connection
        to tell the remote it may free its export on: ``_release_remote``)."""
        p = pull.params
        t0 = time.monotonic()
        conn: PeerConnection | None = None
        try:
            if self._run_in_place(pull, t0):
                return True
            conn, manifest, requested = self._manifest(pull)
            layout = Layout.from_dict(manifest.get("layout"))
            record = _record(manifest.get("meta"), pull.expect)  # before a byte moves
            if layout.total_bytes != p.remote_total_bytes:
                raise TransferFailed(
                    "protocol",
                    f"the remote export has {layout.total_bytes} bytes, the params say "
                    f"{p.remote_total_bytes}",
                )
            with self._cond:
                imp = self.store.reserve_import(pull.pull_id, layout.total_bytes)
                pull.offset = imp.offset
            dest = self.store.region.view(imp.offset, layout.total_bytes)
            conn.settimeout(
                min(self.cfg.io_timeout_s, max(pull.deadline - time.monotonic(), 0.001))
            )
            t_data = time.monotonic()
            with dest:
                self.transport.fetch(
                    FetchJob(
                        control=conn,
                        connect=lambda: self._connect(p.remote_host, p.remote_port),
                        transfer_id=p.remote_transfer_id,
                        dest=dest,
                        progress=lambda n: self._progress(pull, n),
                        deadline=pull.deadline,
                        requested=requested,
                    )
                )
                data_s = max(time.monotonic() - t_data, 1e-9)
                if record is not None:  # before anyone may read them
                    record.verify(layout, dest)
        except BaseException as e:
            if conn is not None:
                conn.close()
            self._fail(pull, e)
            return False
        pull.peer = conn
        self._complete(pull, layout, manifest, t0, data_s)
        return True

    def _run_in_place(self, pull: Pull, t0: float) -> bool:
        """The pull without a round trip, where the transport reads the export in place: the
        manifest from its trailer, the copy, the trailer checked intact after it (then the
        bytes were the export's throughout: ``staging.Trailer``). -> whether it landed; if
        not, nothing is left reserved and the caller asks the peer."""
        p = pull.params
        src = self.transport.direct_source(p)
        trailer = src.trailer() if src is not None else None
        if src is None or trailer is None:
            return False
        raw_layout, _, raw_meta = trailer.manifest.partition(b"\n")
        try:
            layout = self._layouts.get(raw_layout)
            meta = json.loads(raw_meta)
        except ValueError:  # (LayoutError is one)
            return False
        if layout.total_bytes != p.remote_total_bytes:
            return False
        record = _record(meta, pull.expect)  # a mismatch fails the pull (the peer has no other)
        with self._cond:  # (the gauges follow in _record, after the answer)
            imp = self.store.reserve_import(pull.pull_id, layout.total_bytes, gauges=False)
            pull.offset = imp.offset
        landed = False
        try:
            t_data = time.monotonic()
            with self.store.region.view(imp.offset, layout.total_bytes) as dest:
                src.copy_into(dest, pull.deadline)
                data_s = max(time.monotonic() - t_data, 1e-9)
                landed = trailer.intact()
                if landed and record is not None:
                    landed = False  # (until verified: dropped if not)
                    record.verify(layout, dest)
                    landed = True
        finally:
            if not landed:
                with self._cond:
                    self.store.drop_import(pull.pull_id, "aborted")
                    pull.offset = None
        if not landed:
            return False
        self._progress(pull, layout.total_bytes)
        self._complete(pull, layout, {"meta": meta}, t0, data_s)
        return True

    def _release_remote(self, pull: Pull) -> None:
        """Every byte is ours: the prefill side frees its export (the engine goes on meanwhile:
        the pull is ``done`` already). An in-place pull has no connection yet: a pooled one,
        or a new one."""
        conn, pull.peer = pull.peer, None
        p = pull.params
        try:
            if conn is None and (conn := self._pooled(p.remote_host, p.remote_port)) is not None:
                try:  # a pooled connection may have gone stale: then a fresh one
                    conn.settimeout(self.cfg.io_timeout_s)
                    conn.release(p.remote_transfer_id)
                    self._give_back(conn)
                    return
                except (OSError, FrameError):
                    conn.close()
                    conn = None
            if conn is None:
                conn = self._connect(p.remote_host, p.remote_port)
            conn.settimeout(self.cfg.io_timeout_s)
            conn.release(p.remote_transfer_id)
        except Exception as e:
            if conn is not None:
                conn.close()
            self.log.warning(
                "pull %s done, but releasing transfer %s failed (its lease will free it): %s",
                pull.pull_id,
                pull.params.remote_transfer_id,
                e,
            )
            return
        self._give_back(conn)

    def _complete(
        self, pull: Pull, layout: Layout, manifest: dict[str, Any], t0: float, data_s: float
    ) -> None:
        pull.timing = (t0, data_s)
        with self._cond:
            pull.finished = time.monotonic()
            if pull.cancelled:
                self.store.drop_import(pull.pull_id, "aborted")
                del self.pulls[pull.pull_id]
            else:
                pull.expires_at = self.store.complete_import(pull.pull_id, self.cfg.lease_seconds)
                pull.layout = layout
                meta = manifest.get("meta")
                pull.remote_meta = meta if isinstance(meta, dict) else {}
                pull.state = "done"
            self._cond.notify_all()
        if self.spans is not None:  # ends now (the metrics wait until after the answer)
            p = pull.params
            remote = f"{p.remote_host}:{p.remote_port}"
            self.spans.transfer(
                pull.traceparent, pull.started_ns, layout.total_bytes, data_s, remote
            )

    def _record(self, pull: Pull) -> None:
        """A landed pull in the metrics."""
        name, nbytes = self.transport.name, pull.total_bytes
        (t0, data_s), end = pull.timing, pull.finished or time.monotonic()
        self.store.update_gauges()
        self.metrics.pulls.labels("done").inc()
        self.metrics.bytes_moved.labels("received", name).inc(nbytes)
        self.metrics.transfer_seconds.labels(name).observe(end - t0)
        self.metrics.bandwidth.labels(name).observe(nbytes / data_s)

    def _fail(self, pull: Pull, e: BaseException) -> None:
        reason = classify(e)
        message = f"{type(e).__name__}: {e}" if not isinstance(e, AuthError) else str(e)
        p = pull.params
        self.log.warning(
            "pull %s of transfer %s from %s:%d failed (%s): %s",
            pull.pull_id,
            p.remote_transfer_id,
            p.remote_host,
            p.remote_port,
            reason,
            message,
        )
        with self._cond:
            self.store.drop_import(pull.pull_id, "aborted")
            pull.state = "failed"
            pull.error = f"KV pull from {p.remote_host}:{p.remote_port} failed: {message}"
            pull.reason = reason
            pull.finished = time.monotonic()
            if pull.cancelled:
                self.pulls.pop(pull.pull_id, None)
            self._cond.notify_all()
        self.metrics.pulls.labels("failed").inc()
        self.metrics.pull_failures.labels(reason).inc()
        if self.spans is not None:
            remote = f"{p.remote_host}:{p.remote_port}"
            self.spans.transfer(
                pull.traceparent, pull.started_ns, pull.bytes_done, None, remote, message, reason
            )


def _record(meta: object, expect: Fingerprint | None) -> IntegrityRecord | None:
    """An export's integrity record, its fingerprint checked (``IntegrityError``)."""
    record = IntegrityRecord.from_meta(meta if isinstance(meta, dict) else {})
    check_fingerprint(record, expect)
    return record
