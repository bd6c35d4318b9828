"""The staging region and its ledger behind one lock: the one object the export API, the puller
and the peer server share.

Every ledger call takes the lock; every extent freed (whoever frees it, for whatever reason) is
counted in the metrics and the gauges follow, here and nowhere else. It is the peer server's
``ExportSource``; the puller reserves, completes and drops its imports through it.

With a disk tier (``attach_disk``) the host tier's LRU spills into it, and an export asked for
by id that the host tier no longer holds but the disk tier does is read back into the host
tier first (``_promote``), so every pull path serves it unchanged.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsv4_common.kv_events import MEDIUM_DISK, MEDIUM_HOST
from dsv4_kvtransfer.buffers import Layout
from dsv4_kvtransfer.disk_tier import DiskTier
from dsv4_kvtransfer.host_evictions import EvictionLog
from dsv4_kvtransfer.integrity import META_KEY
from dsv4_kvtransfer.kv_spans import SidecarSpans
from dsv4_kvtransfer.ledger import Export, Freed, FreeReason, Import, Ledger, LedgerError
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.staging import TRAILER, StagingRegion

log = logging.getLogger("dsv4.kv.store")


@dataclass(frozen=True, slots=True)
class ExportView:
    """An export as it was when asked about (the ledger's own record keeps changing)."""

    transfer_id: str
    offset: int
    layout: Layout
    meta: dict[str, Any]
    state: str
    pins: int
    expires_at: float
    """``time.monotonic()`` at which the lease runs out."""
    trailer: int = 0
    """Bytes of its trailer (0: none; ``StagingStore(publish=True)``)."""


@dataclass(frozen=True, slots=True)
class Usage:
    staging_bytes: int
    free_bytes: int
    used_bytes: int
    largest_free: int
    exports: int
    imports: int
    granted_bytes: int = 0
    """Held by engines' clients to copy into (``grant``), counted in ``used_bytes``."""
    cached_entries: int = 0
    """Host-tier entries (cached exports: not in ``exports``, which a drain waits for)."""
    cached_bytes: int = 0


def wall_time(mono: float) -> float:
    """A ``time.monotonic()`` deadline (the ledger's clock) as unix time (the wire's)."""
    return time.time() + (mono - time.monotonic())


def _view(exp: Export) -> ExportView:
    return ExportView(
        exp.transfer_id,
        exp.offset,
        exp.layout,
        exp.meta,
        exp.state,
        exp.pins,
        exp.expires_at,
        exp.trailer,
    )


def manifest_bytes(layout: Layout, meta: dict[str, Any]) -> bytes:
    """An export's manifest as its trailer holds it: the ``MANIFEST`` frame's layout and meta,
    as two lines of JSON (the layout alone, so a puller can reuse what it parsed before)."""
    return b"%s\n%s" % (
        json.dumps(layout.to_dict(), separators=(",", ":")).encode(),
        json.dumps(meta, separators=(",", ":")).encode(),
    )


class StagingStore:
    def __init__(
        self,
        region: StagingRegion,
        ledger: Ledger,
        metrics: SidecarMetrics,
        rdma_session: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        publish: bool = False,
    ) -> None:
        self.region = region
        self.ledger = ledger
        self.host_evictions = EvictionLog()  # host-tier entries evicted, for the engine
        # publish: each export gets a trailer (written at commit, retired before it goes), so
        # a same-host puller needs no round trip to the peer port before copying
        self.publish = publish
        self._manifests: dict[str, bytes] = {}  # reserved, not yet committed
        if publish:
            ledger.retire = self._retire
        self.metrics = metrics
        self.clock = clock
        self._rdma_session = rdma_session
        self._lock = threading.Lock()
        self.spans: SidecarSpans | None = None
        self.disk: DiskTier | None = None
        self._promote_lock = threading.Lock()  # one read-back at a time
        metrics.staging_total.set(ledger.alloc.size)
        self._gauges()

    def attach_disk(self, disk: DiskTier) -> None:
        """Spill the host tier's LRU evictions into ``disk`` (opened), read them back on use."""
        self.disk = disk
        disk.on_gone = self.host_evictions.add
        self.ledger.spill = self._spill

    # ---- accounting ------------------------------------------------------------------------

    def _settle(self, freed: list[Freed]) -> None:
        """Count what was freed and bring the gauges up to date (called without the lock)."""
        with self._lock:
            evicted = self.ledger.take_evicted()
            freed = freed + evicted
        if evicted:  # (a spilled one is still here: on disk)
            self.host_evictions.add(f.key for f in evicted if f.reason == "evicted")
            spilled = [f.key for f in evicted if f.reason == "spilled"]
            self.host_evictions.add_moves(spilled, MEDIUM_DISK)
        for f in freed:
            self.metrics.releases.labels(f.kind, f.reason).inc()
            if f.reason == "expired":
                self.metrics.lease_expiries.labels(f.kind).inc()
            if self.spans is not None and f.kind == "export":
                self.spans.export_freed(f.key, f.reason)
        self._gauges()

    def _gauges(self) -> None:
        u = self.usage()
        self.metrics.staging_free.set(u.free_bytes)
        self.metrics.active_exports.set(u.exports)
        self.metrics.active_imports.set(u.imports)
        self.metrics.host_tier_bytes.set(u.cached_bytes)
        self.metrics.host_tier_entries.set(u.cached_entries)

    def usage(self) -> Usage:
        with self._lock:
            a, led = self.ledger.alloc, self.ledger
            granted = [i.capacity for i in led.imports.values() if i.granted]
            return Usage(
                a.size,
                a.free_bytes,
                a.used_bytes,
                a.largest_free,
                len(led.exports) - len(led.cached),
                len(led.imports) - len(granted),
                sum(granted),
                len(led.cached),
                led.cached_bytes,
            )

    # ---- exports: the engine's side ---------------------------------------------------------

    def reserve_export(
        self,
        transfer_id: str,
        layout: Layout,
        meta: dict[str, Any],
        ttl: float,
        cached: bool = False,
    ) -> ExportView:
        """Raises ``LedgerError`` (``staging_full``, ``duplicate``; ``no_host_tier`` for a
        cached export that cannot fit the tier). An offer of an entry the disk tier holds
        reads it back (a use, as a duplicate offer is in the host tier): ``duplicate``."""
        if cached:
            self._promote(transfer_id)
        view = self._reserve(transfer_id, layout, meta, ttl, cached)
        self.metrics.exports.inc()
        self._settle([])
        return view

    def _reserve(
        self, transfer_id: str, layout: Layout, meta: dict[str, Any], ttl: float, cached: bool
    ) -> ExportView:
        manifest = manifest_bytes(layout, meta) if self.publish else b""
        trailer = TRAILER.size + len(manifest) if manifest else 0
        with self._lock:
            exp = self.ledger.reserve_export(
                transfer_id, layout, meta, self.clock(), ttl, trailer, cached
            )
            if trailer:
                self._manifests[transfer_id] = manifest
            return _view(exp)

    def commit_export(
        self, transfer_id: str, ttl: float, integrity: dict[str, Any] | None = None
    ) -> ExportView:
        """The engine wrote the buffers: the export is ready and its lease starts again.
        ``integrity``: its record with the checksums (``integrity.IntegrityRecord``), in place
        of the reservation's placeholder, as long (fixed-width sums): its trailer's room."""
        with self._lock:
            exp = self.ledger.exports.get(transfer_id)
            manifest = self._manifests.get(transfer_id)
            if exp is not None and integrity is not None and exp.state == "reserved":
                meta = {**exp.meta, META_KEY: integrity}
                if manifest is not None:
                    new = manifest_bytes(exp.layout, meta)
                    if len(new) != len(manifest):
                        raise LedgerError("bad_integrity", "the record changed the manifest's size")
                    manifest = new
            exp = self.ledger.commit_export(transfer_id, self.clock(), ttl)
            if integrity is not None:
                exp.meta[META_KEY] = integrity
            self._manifests.pop(transfer_id, None)
            if manifest is not None:
                self.region.publish(exp.offset + exp.layout.total_bytes, transfer_id, manifest)
            return _view(exp)

    def export(self, transfer_id: str) -> ExportView | None:
        with self._lock:
            exp = self.ledger.exports.get(transfer_id)
            return _view(exp) if exp is not None else None

    def abort_export(self, transfer_id: str) -> bool:
        """Free now, or when the current reader unpins; -> whether it was freed now."""
        with self._lock:
            freed = self.ledger.release_export(transfer_id, "aborted")
        self._settle([freed] if freed else [])
        return freed is not None

    def _retire(self, exp: Export) -> None:
        """The ledger's hook (under our lock): the export is going, its trailer first."""
        self._manifests.pop(exp.transfer_id, None)
        if exp.trailer and exp.state == "ready":
            self.region.retire(exp.offset + exp.layout.total_bytes)

    # ---- exports: the peer server's side (ExportSource) ------------------------------------

    def ready_export(self, transfer_id: str) -> Export:
        self._promote(transfer_id)
        with self._lock:
            return self.ledger.ready_export(transfer_id)

    def pin_export(self, transfer_id: str) -> Export:
        self._promote(transfer_id)
        with self._lock:
            return self.ledger.pin(transfer_id)

    # ---- the disk tier -----------------------------------------------------------------------

    def _spill(self, exp: Export) -> bool:
        """The ledger's hook (under our lock): offer an evicted entry to the disk tier."""
        assert self.disk is not None
        data = bytes(self.region.view(exp.offset, exp.layout.total_bytes))
        return self.disk.spill(exp.transfer_id, exp.layout, dict(exp.meta), data)

    def _promote(self, transfer_id: str, ttl: float = 30.0) -> None:
        """An entry asked for that the host tier spilled: read it back (checked) into the
        host tier, as a committed cached export (its manifest, integrity record included, as
        it was). If the host tier has no room it goes back to disk."""
        disk = self.disk
        if disk is None or transfer_id not in disk:
            return
        with self._promote_lock:
            with self._lock:
                if transfer_id in self.ledger.exports:
                    return
            got = disk.take(transfer_id)
            if got is None:
                return
            layout, meta, data = got
            try:
                view = self._reserve(transfer_id, layout, meta, ttl, cached=True)
            except LedgerError as e:
                log.info("disk tier: %s stays on disk (%s)", transfer_id, e)
                if not disk.spill(transfer_id, layout, meta, bytes(data)):
                    self.host_evictions.add([transfer_id])
                self._settle([])
                return
            self.region.view(view.offset, layout.total_bytes)[:] = data
            self.commit_export(transfer_id, ttl)
            self._settle([])  # (those spilled for its room are logged first)
            self.host_evictions.add_moves([transfer_id], MEDIUM_HOST)

    def unpin_export(self, transfer_id: str) -> None:
        with self._lock:
            freed = self.ledger.unpin(transfer_id)
        if freed:
            self._settle([freed])

    def release_export(self, transfer_id: str) -> None:
        with self._lock:
            freed = self.ledger.release_export(transfer_id, "pulled")
        self._settle([freed] if freed else [])

    def rdma_session(self) -> str | None:
        return self._rdma_session

    # ---- imports: the puller's side ---------------------------------------------------------

    def reserve_import(self, pull_id: str, nbytes: int, gauges: bool = True) -> Import:
        """Raises ``LedgerError`` (``staging_full``, ``duplicate``). ``gauges=False``: the
        caller brings them up to date later (``update_gauges``), off its critical path."""
        with self._lock:
            imp = self.ledger.reserve_import(pull_id, nbytes)
            evicted = bool(self.ledger.evicted)
        if gauges or evicted:
            self._settle([])
        return imp

    # ---- grants: extents an engine's client copies same-host pulls into itself -----------------

    def grant(self, grant_id: str, nbytes: int) -> Import:
        """An extent held for an engine's client (no lease: its holder frees it with
        ``drop_grant`` when its connection goes). Raises ``LedgerError`` (``staging_full``)."""
        with self._lock:
            imp = self.ledger.reserve_import(grant_id, nbytes)
            imp.granted = True
        self._settle([])
        return imp

    def drop_grant(self, grant_id: str) -> bool:
        """Free a grant its client never used; -> whether it was still one."""
        with self._lock:
            imp = self.ledger.imports.get(grant_id)
            if imp is None or not imp.granted:
                return False
            freed = self.ledger.drop_import(grant_id, "aborted")
        self._settle([freed] if freed else [])
        return True

    def adopt(self, grant_id: str, nbytes: int, ttl: float) -> tuple[int, float]:
        """The client copied a pull's ``nbytes`` into its grant: from now on a landed pull's
        import under a lease (``complete_import``); -> its offset and expiry. ``KeyError`` /
        ``ValueError`` if it is no grant or too small (it stays as it was)."""
        with self._lock:
            imp = self.ledger.imports[grant_id]
            if not imp.granted or not 0 < nbytes <= imp.capacity:
                raise ValueError(f"{grant_id} is no grant of at least {nbytes} bytes")
            imp.granted, imp.nbytes = False, nbytes
            imp = self.ledger.complete_import(grant_id, self.clock(), ttl)
            assert imp.expires_at is not None
            return imp.offset, imp.expires_at

    def update_gauges(self) -> None:
        self._gauges()

    def complete_import(self, pull_id: str, ttl: float) -> float:
        """Every byte is in: the engine has ``ttl`` seconds to take it; -> that expiry."""
        with self._lock:
            imp = self.ledger.complete_import(pull_id, self.clock(), ttl)
            assert imp.expires_at is not None
            return imp.expires_at

    def drop_import(self, pull_id: str, reason: FreeReason) -> bool:
        """Free a pull's extent (if it has one); -> whether something was freed."""
        with self._lock:
            freed = self.ledger.drop_import(pull_id, reason)
        self._settle([freed] if freed else [])
        return freed is not None

    # ---- leases ----------------------------------------------------------------------------

    def sweep(self) -> list[Freed]:
        """Free every export and import whose lease ran out."""
        with self._lock:
            freed = self.ledger.sweep(self.clock())
        self._settle(freed)
        return freed
