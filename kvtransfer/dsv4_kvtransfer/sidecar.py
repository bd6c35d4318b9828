"""The KV sidecar: staging region, exports under leases, the peer port, pulls, the sweeper.

One per engine pod. The engine talks to it over the local control API (``control.py``); remote
sidecars over the peer port (``peer_server.py``). All bookkeeping goes through ``Ledger`` under
one lock; bytes move outside the lock, straight between sockets (or mappings) and the region.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
import urllib.request
from typing import Any

from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import BufferSpec, Layout, LayoutError
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.frames import FrameLimits
from dsv4_kvtransfer.ledger import Export, Freed, Ledger, LedgerError
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_kvtransfer.peer_server import PeerServer, PeerServerConfig
from dsv4_kvtransfer.puller import Puller
from dsv4_kvtransfer.staging import HEADER_BYTES, StagingRegion
from dsv4_kvtransfer.transports import Transport, make_transport

# the manifest (layout + engine meta) travels in one frame header; keep it well under the limit
MAX_MANIFEST_JSON = 512 << 10
MAX_ENGINE_META_JSON = 16 << 10
# block ids travel in the manifest too (a 1M-token prompt in 64-token blocks is 16K ids)
MAX_BLOCK_IDS = 65536


class ApiError(Exception):
    """An engine request the sidecar refuses: HTTP ``status``, short ``code``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _opt_int(d: dict[str, Any], key: str, lo: int = 0) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ApiError(400, "bad_request", f"{key} must be an integer >= {lo}")
    return v


def _wall(mono: float) -> float:
    """A monotonic deadline as unix time (what goes on the wire)."""
    return time.time() + (mono - time.monotonic())


class Sidecar:
    def __init__(self, cfg: SidecarConfig, log: logging.Logger | None = None) -> None:
        self.cfg = cfg
        self.log = log or logging.getLogger("dsv4.kv.sidecar")
        self.metrics = SidecarMetrics()
        # fail fast on a transport that cannot run here, before anything is created
        self.transport: Transport = make_transport(cfg.transport, **self._transport_options())
        self.region = StagingRegion.create(cfg.shm_name, cfg.staging_bytes, cfg.shm_dir)
        self.lock = threading.Lock()
        self.ledger = Ledger(ExtentAllocator(HEADER_BYTES, cfg.staging_bytes - HEADER_BYTES))
        self._rdma_session: str | None = None
        if cfg.transport == "rdma":
            from dsv4_kvtransfer.transports.rdma import RdmaTransport

            assert isinstance(self.transport, RdmaTransport)
            self._rdma_session = self.transport.bind(self.region).session
        self.limits = FrameLimits(max_payload=cfg.max_frame_bytes)
        self.puller = Puller(self)
        self.peer = PeerServer(
            PeerServerConfig(
                host=cfg.host,
                port=cfg.port,
                server_id=cfg.sidecar_id,
                token=cfg.token,
                limits=self.limits,
                max_connections=cfg.max_connections,
                io_timeout_s=cfg.io_timeout_s,
                send_rate=cfg.send_rate,
            ),
            self,
            self.metrics,
            self.log,
        )
        self.port = cfg.port
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.engine_status = "unknown"
        self.metrics.staging_total.set(self.ledger.alloc.size)
        self._update_gauges()

    def _transport_options(self) -> dict[str, Any]:
        c = self.cfg
        if c.transport == "tcp":
            return {"streams": c.streams, "min_stream_bytes": c.min_stream_bytes}
        if c.transport == "shm":
            return {"shm_dir": c.shm_dir}
        if c.transport in ("hccl", "gloo"):
            return {"timeout_s": c.io_timeout_s}
        return {"hostname": c.advertise_host}

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> int:
        self.port = self.peer.start()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kv-sweeper", daemon=True)
        self._sweeper.start()
        self.log.info(
            "kv sidecar %s: peer port %s:%d (advertised %s), transport %s, staging %s/%s "
            "(%d bytes), lease %.1fs",
            self.cfg.sidecar_id,
            self.cfg.host,
            self.port,
            self.cfg.advertise_host,
            self.cfg.transport,
            self.cfg.shm_dir,
            self.cfg.shm_name,
            self.ledger.alloc.size,
            self.cfg.lease_seconds,
        )
        return self.port

    def stop(self) -> None:
        self._stop.set()
        self.peer.stop()
        self.puller.stop()
        self.transport.close()
        self.region.close()

    def _sweep_loop(self) -> None:
        every = min(0.25, self.cfg.lease_seconds / 4)
        last_probe = 0.0
        while not self._stop.wait(every):
            self.sweep()
            if self.cfg.engine_url and time.monotonic() - last_probe > 10:
                last_probe = time.monotonic()
                self.engine_status = _probe(self.cfg.engine_url)

    def sweep(self) -> list[Freed]:
        with self.lock:
            freed = self.ledger.sweep(time.monotonic())
        for f in freed:
            self._account(f)
            self.log.info("lease expired: %s %s (%d bytes freed)", f.kind, f.key, f.nbytes)
        if freed:
            self.puller.on_expired([f.key for f in freed if f.kind == "import"])
        self.puller.prune()
        self._update_gauges()
        return freed

    def _account(self, f: Freed) -> None:
        self.metrics.releases.labels(f.kind, f.reason).inc()
        if f.reason == "expired":
            self.metrics.lease_expiries.labels(f.kind).inc()

    def _update_gauges(self) -> None:
        with self.lock:
            free = self.ledger.alloc.free_bytes
            ne, ni = len(self.ledger.exports), len(self.ledger.imports)
        self.metrics.staging_free.set(free)
        self.metrics.active_exports.set(ne)
        self.metrics.active_imports.set(ni)

    # ---- engine side: exports ----------------------------------------------------------------

    def reserve_export(self, body: dict[str, Any]) -> dict[str, Any]:
        raw = body.get("buffers")
        if not isinstance(raw, list):
            raise ApiError(400, "bad_request", "buffers must be a list of {name, dtype, shape}")
        try:
            layout = Layout.plan(BufferSpec.from_dict(b) for b in raw)
        except LayoutError as e:
            raise ApiError(400, "bad_layout", str(e)) from None
        if len(json.dumps(layout.to_dict())) > MAX_MANIFEST_JSON:
            raise ApiError(400, "bad_layout", "the buffer list is too long for one manifest")
        meta = self._export_meta(body)
        ttl = body.get("lease_seconds", self.cfg.lease_seconds)
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 0 < ttl <= 3600:
            raise ApiError(400, "bad_request", "lease_seconds must be in (0, 3600]")
        tid = secrets.token_hex(12)
        with self.lock:
            try:
                exp = self.ledger.reserve_export(tid, layout, meta, time.monotonic(), float(ttl))
            except LedgerError as e:
                raise ApiError(507, e.code, str(e)) from None
            exp.meta["lease_seconds"] = float(ttl)
        self.metrics.exports.inc()
        self._update_gauges()
        return {
            "transfer_id": tid,
            "shm_name": self.region.name,
            "shm_tag": self.region.tag.hex(),
            "offset": exp.offset,
            "total_bytes": layout.total_bytes,
            "buffers": [{**b.to_dict(), "offset": exp.offset + b.offset} for b in layout.buffers],
            "lease_expires_at": _wall(exp.expires_at),
        }

    def _export_meta(self, body: dict[str, Any]) -> dict[str, Any]:
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
            raise ApiError(400, "bad_request", "request_id must be a non-empty string")
        engine_id = body.get("engine_id", self.cfg.engine_id)
        if not isinstance(engine_id, str) or not 0 < len(engine_id) <= 256:
            raise ApiError(400, "bad_request", "engine_id must be a non-empty string")
        block_ids = body.get("block_ids", [])
        if (
            not isinstance(block_ids, list)
            or len(block_ids) > MAX_BLOCK_IDS
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids)
        ):
            raise ApiError(
                400,
                "bad_request",
                f"block_ids must be a list of at most {MAX_BLOCK_IDS} non-negative integers",
            )
        groups = body.get("cache_groups", {})
        if not isinstance(groups, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in groups.items()
        ):
            raise ApiError(400, "bad_request", "cache_groups must map names to counts")
        engine_meta = body.get("engine_meta", {})
        if not isinstance(engine_meta, dict):
            raise ApiError(400, "bad_request", "engine_meta must be an object")
        if len(json.dumps(engine_meta)) > MAX_ENGINE_META_JSON:
            raise ApiError(400, "bad_request", f"engine_meta is over {MAX_ENGINE_META_JSON} bytes")
        # fields the engine wants in kv_transfer_params (e.g. what the decode side must check
        # before pulling); the protocol's own fields cannot be overridden
        params_extra = body.get("params_extra", {})
        if not isinstance(params_extra, dict) or any(
            not isinstance(k, str) or k in RemotePrefillParams.KNOWN for k in params_extra
        ):
            raise ApiError(
                400, "bad_request", "params_extra must be an object of non-protocol fields"
            )
        if len(json.dumps(params_extra)) > MAX_ENGINE_META_JSON:
            raise ApiError(400, "bad_request", f"params_extra is over {MAX_ENGINE_META_JSON} bytes")
        return {
            "request_id": request_id,
            "engine_id": engine_id,
            "block_ids": block_ids,
            "num_tokens": _opt_int(body, "num_tokens") or 0,
            "state_slot": _opt_int(body, "state_slot"),
            "cache_groups": groups,
            "engine_meta": engine_meta,
            "params_extra": params_extra,
        }

    def commit_export(self, tid: str) -> dict[str, Any]:
        with self.lock:
            try:
                exp = self.ledger.exports[tid]
                ttl = float(exp.meta["lease_seconds"])
                exp = self.ledger.commit_export(tid, time.monotonic(), ttl)
            except KeyError:
                raise ApiError(
                    404, "unknown_transfer", f"unknown or expired transfer {tid}"
                ) from None
            except LedgerError as e:
                raise ApiError(409, e.code, str(e)) from None
            m = exp.meta
            params = RemotePrefillParams(
                remote_engine_id=m["engine_id"],
                remote_request_id=m["request_id"],
                remote_block_ids=tuple(m["block_ids"]),
                remote_host=self.cfg.advertise_host,
                remote_port=self.port,
                remote_transfer_id=tid,
                remote_lease_expires_at=round(_wall(exp.expires_at), 3),
                remote_num_tokens=m["num_tokens"],
                remote_total_bytes=exp.layout.total_bytes,
                remote_state_slot=m["state_slot"],
                remote_cache_groups=dict(m["cache_groups"]),
                extra=dict(m.get("params_extra") or {}),
            )
        return {"transfer_id": tid, "kv_transfer_params": params.to_dict()}

    def abort_export(self, tid: str) -> dict[str, Any]:
        with self.lock:
            try:
                freed = self.ledger.release_export(tid, "aborted")
            except LedgerError as e:
                raise ApiError(404, e.code, str(e)) from None
        if freed:
            self._account(freed)
        self._update_gauges()
        return {"transfer_id": tid, "freed": freed is not None}

    def export_status(self, tid: str) -> dict[str, Any]:
        with self.lock:
            exp = self.ledger.exports.get(tid)
            if exp is None:
                raise ApiError(404, "unknown_transfer", f"unknown or expired transfer {tid}")
            return {
                "transfer_id": tid,
                "state": exp.state,
                "pins": exp.pins,
                "total_bytes": exp.layout.total_bytes,
                "lease_expires_at": _wall(exp.expires_at),
            }

    # ---- peer side (ExportSource for the peer server) ---------------------------------------

    def ready_export(self, transfer_id: str) -> Export:
        with self.lock:
            return self.ledger.ready_export(transfer_id)

    def pin_export(self, transfer_id: str) -> Export:
        with self.lock:
            return self.ledger.pin(transfer_id)

    def unpin_export(self, transfer_id: str) -> None:
        with self.lock:
            freed = self.ledger.unpin(transfer_id)
        if freed:
            self._account(freed)
            self._update_gauges()

    def release_export(self, transfer_id: str) -> None:
        with self.lock:
            freed = self.ledger.release_export(transfer_id, "pulled")
        if freed:
            self._account(freed)
        self._update_gauges()

    def rdma_session(self) -> str | None:
        return self._rdma_session

    # ---- status ------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        with self.lock:
            alloc = self.ledger.alloc
            out = {
                "sidecar_id": self.cfg.sidecar_id,
                "pid": os.getpid(),
                "transport": self.cfg.transport,
                "advertise_host": self.cfg.advertise_host,
                "port": self.port,
                "shm_name": self.region.name,
                "shm_tag": self.region.tag.hex(),
                "shm_dir": self.cfg.shm_dir,
                "header_bytes": HEADER_BYTES,
                "staging_bytes": alloc.size,
                "free_bytes": alloc.free_bytes,
                "used_bytes": alloc.used_bytes,
                "largest_free": alloc.largest_free,
                "exports": len(self.ledger.exports),
                "imports": len(self.ledger.imports),
                "lease_seconds": self.cfg.lease_seconds,
                "max_frame_bytes": self.cfg.max_frame_bytes,
            }
        out["pulls"] = self.puller.count()
        return out

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "transport": self.cfg.transport,
            "engine": self.engine_status,
        }


def _probe(url: str) -> str:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=1) as r:
            return "ok" if r.status == 200 else f"http {r.status}"
    except Exception:
        return "unreachable"
