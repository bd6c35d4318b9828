"""The engine's exports: reserve an extent for a request's KV, commit it into
``kv_transfer_params`` for the prefill response, abort it, ask about it."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.control_requests import ExportRequest
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.integrity import META_KEY, IntegrityRecord, buffer_checksums
from dsv4_kvtransfer.kv_spans import SidecarSpans
from dsv4_kvtransfer.ledger import LedgerError
from dsv4_kvtransfer.pd_protocol import SHM_SOURCE, RemotePrefillParams, prefix_transfer_id
from dsv4_kvtransfer.store import ExportView, StagingStore, wall_time


class Exports:
    def __init__(
        self, store: StagingStore, cfg: SidecarConfig, peer_port: Callable[[], int]
    ) -> None:
        self.store = store
        self.cfg = cfg
        # the peer port is known once the server listens (port 0 picks one)
        self._peer_port = peer_port
        self.draining = False  # shutting down: no new exports (the held ones stay pullable)
        self.spans: SidecarSpans | None = None

    def reserve(self, req: ExportRequest, traceparent: str | None = None) -> dict[str, Any]:
        if self.draining:
            raise ApiError(
                503, "draining", "the KV sidecar is shutting down and takes no new exports"
            )
        ttl = req.lease_seconds or self.cfg.lease_seconds
        meta = {
            "request_id": req.request_id,
            "engine_id": req.engine_id or self.cfg.engine_id,
            "block_ids": list(req.block_ids),
            "num_tokens": req.num_tokens,
            "state_slot": req.state_slot,
            "cache_groups": dict(req.cache_groups),
            "engine_meta": dict(req.engine_meta),
            "params_extra": dict(req.params_extra),
            "lease_seconds": ttl,
            # zeros until the commit computes the checksums (same length: the trailer's size)
            META_KEY: IntegrityRecord.placeholder(req.layout, req.fingerprint).to_dict(),
        }
        cached = req.prefix_key is not None
        tid = prefix_transfer_id(req.prefix_key) if req.prefix_key else secrets.token_hex(12)
        try:
            exp = self.store.reserve_export(tid, req.layout, meta, ttl, cached)
        except LedgerError as e:
            status = {"duplicate": 409, "no_host_tier": 409}.get(e.code, 507)
            raise ApiError(status, e.code, str(e)) from None
        if self.spans is not None:
            self.spans.export_reserved(tid, traceparent, exp.layout.total_bytes, req.request_id)
        region = self.store.region
        return {
            "transfer_id": tid,
            "shm_name": region.name,
            "shm_tag": region.tag_hex,
            "offset": exp.offset,
            "total_bytes": exp.layout.total_bytes,
            "buffers": [
                {**b.to_dict(), "offset": exp.offset + b.offset} for b in exp.layout.buffers
            ],
            "lease_expires_at": wall_time(exp.expires_at),
        }

    def commit(self, tid: str) -> dict[str, Any]:
        exp = self._get(tid)
        record = self._integrity(exp)
        try:
            exp = self.store.commit_export(tid, float(exp.meta["lease_seconds"]), record)
        except LedgerError as e:
            status = 404 if e.code == "unknown_transfer" else 409
            raise ApiError(status, e.code, str(e)) from None
        m = exp.meta
        extra = dict(m["params_extra"])
        if exp.trailer:  # published: a same-host puller may copy without asking first
            region = self.store.region
            extra[SHM_SOURCE] = {"name": region.name, "tag": region.tag_hex, "offset": exp.offset}
        params = RemotePrefillParams(
            remote_engine_id=m["engine_id"],
            remote_request_id=m["request_id"],
            remote_block_ids=tuple(m["block_ids"]),
            remote_host=self.cfg.advertise_host,
            remote_port=self._peer_port(),
            remote_transfer_id=tid,
            remote_lease_expires_at=round(wall_time(exp.expires_at), 3),
            remote_num_tokens=m["num_tokens"],
            remote_total_bytes=exp.layout.total_bytes,
            remote_state_slot=m["state_slot"],
            remote_cache_groups=dict(m["cache_groups"]),
            extra=extra,
        )
        return {"transfer_id": tid, "kv_transfer_params": params.to_dict()}

    def _integrity(self, exp: ExportView) -> dict[str, Any] | None:
        """The export's record with the checksums of the bytes the engine wrote (read outside
        the store's lock: a reserved extent is its writer's until the commit)."""
        if exp.state != "reserved":
            return None  # (the commit refuses it)
        with self.store.region.view(exp.offset, exp.layout.total_bytes) as extent:
            sums = buffer_checksums(exp.layout, extent)
        rec = IntegrityRecord.from_meta(exp.meta)
        return IntegrityRecord(sums, rec.fingerprint if rec else None).to_dict()

    def abort(self, tid: str) -> dict[str, Any]:
        try:
            freed = self.store.abort_export(tid)
        except LedgerError as e:
            raise ApiError(404, e.code, str(e)) from None
        return {"transfer_id": tid, "freed": freed}

    def status(self, tid: str) -> dict[str, Any]:
        exp = self._get(tid)
        return {
            "transfer_id": tid,
            "state": exp.state,
            "pins": exp.pins,
            "total_bytes": exp.layout.total_bytes,
            "lease_expires_at": wall_time(exp.expires_at),
        }

    def _get(self, tid: str) -> ExportView:
        exp = self.store.export(tid)
        if exp is None:
            raise ApiError(404, "unknown_transfer", f"unknown or expired transfer {tid}")
        return exp
