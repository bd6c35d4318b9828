"""Bookkeeping of the staging region: exports under leases, imports, and when each is freed.

Pure logic: the clock is an argument, nothing here does I/O or locks (the sidecar holds one lock
around every call), so the unit tests assert exact offsets, byte counts and expiry times.

Export (prefill side), one per request whose KV waits for a remote decode::

    reserve (lease starts) -> engine writes its buffers -> commit (lease renewed) -> ready
    ready -> pulled (the puller sent RELEASE) | expired (lease ran out) | aborted (engine)

A remote reader pins an export while it reads; a pinned export does not expire, and a release
while pinned frees it at the last unpin. Import (decode side), one per pull: an extent reserved
when the pull learns the size, ``done`` once every byte is in (a lease starts: the engine must
copy the KV out and release it in time), or dropped on failure.

Cached exports are the **host tier**: an engine offers a finished request's prefix under a
content-derived transfer id (``pd_protocol.prefix_transfer_id``). Once committed it has no
lease and a pull's ``RELEASE`` leaves it: it stays, pullable by anyone holding its id, until
it is evicted least recently used first, when cached bytes would exceed ``host_bytes`` or when
an export or an import finds no free extent (the tier only ever lends the region's idle room);
``spill`` may keep an evicted entry elsewhere first (the disk tier).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import Layout

ExportState = Literal["reserved", "ready"]
FreeReason = Literal["pulled", "expired", "aborted", "evicted", "spilled"]


class LedgerError(Exception):
    """A request the ledger cannot satisfy; ``code`` is a short label for APIs and metrics."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Export:
    transfer_id: str
    offset: int
    """Absolute offset of the extent in the staging region."""
    capacity: int
    layout: Layout
    meta: dict[str, Any]
    expires_at: float
    state: ExportState = "reserved"
    pins: int = 0
    release_pending: FreeReason | None = None
    trailer: int = 0
    """Bytes reserved after the layout's for the export's trailer (``staging.publish``)."""
    cached: bool = False
    """A host-tier entry: no lease once committed, kept after pulls, evicted LRU."""


@dataclass(slots=True)
class Import:
    pull_id: str
    offset: int
    capacity: int
    nbytes: int
    expires_at: float | None = None
    """Set when the pull completes; the engine must release before."""
    granted: bool = False
    """Held for the engine's client to copy into (``StagingStore.grant``): not a pull yet, no
    lease (freed with the client's connection, or adopted as a landed pull)."""


@dataclass(slots=True)
class Freed:
    kind: Literal["export", "import"]
    key: str
    reason: FreeReason
    nbytes: int


@dataclass(slots=True)
class Ledger:
    alloc: ExtentAllocator
    exports: dict[str, Export] = field(default_factory=dict)
    imports: dict[str, Import] = field(default_factory=dict)
    retire: Callable[[Export], None] | None = None
    """Called when an export stops being pullable (released while pinned, or freed: before its
    extent is), so its owner clears what announces it (its trailer)."""
    host_bytes: int = 0
    """Cap on the extents of cached exports (0: no host tier, offers are refused)."""
    cached: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Cached exports' transfer ids -> extent bytes, least recently used first."""
    evicted: list[Freed] = field(default_factory=list)
    """Cached exports evicted since the owner last took them (``take_evicted``)."""
    spill: Callable[[Export], bool] | None = None
    """Offered each cached export the LRU evicts, before its extent is freed: True when it
    kept the entry (the disk tier: freed as ``spilled``, not ``evicted``)."""

    @property
    def cached_bytes(self) -> int:
        return sum(self.cached.values())

    def take_evicted(self) -> list[Freed]:
        out, self.evicted = self.evicted, []
        return out

    def _evict_one(self) -> bool:
        """Free the least recently used unpinned cached export; False if there is none."""
        for tid in self.cached:
            exp = self.exports[tid]
            if exp.pins == 0 and exp.state == "ready":
                kept = self.spill is not None and self.spill(exp)
                self.evicted.append(self._free_export(exp, "spilled" if kept else "evicted"))
                return True
        return False

    def _alloc(self, nbytes: int) -> int | None:
        """An extent of ``nbytes``, evicting cached exports while none is free."""
        while True:
            off = self.alloc.alloc(nbytes)
            if off is not None or not self._evict_one():
                return off

    # ---- exports ---------------------------------------------------------------------------

    def reserve_export(
        self,
        transfer_id: str,
        layout: Layout,
        meta: dict[str, Any],
        now: float,
        ttl: float,
        trailer: int = 0,
        cached: bool = False,
    ) -> Export:
        """``cached``: a host-tier entry (its id is the content's): ``duplicate`` if the tier
        holds it already, ``no_host_tier`` if it could never fit the tier."""
        if transfer_id in self.exports:
            if transfer_id in self.cached:
                self.cached.move_to_end(transfer_id)
            raise LedgerError("duplicate", f"transfer {transfer_id} already exists")
        need = layout.total_bytes + trailer
        if cached:
            if need > self.host_bytes:
                raise LedgerError(
                    "no_host_tier",
                    f"an entry of {need} bytes does not fit the host tier "
                    f"({self.host_bytes} bytes)",
                )
            while self.cached_bytes + need > self.host_bytes and self._evict_one():
                pass
            if self.cached_bytes + need > self.host_bytes:
                raise LedgerError("staging_full", "the host tier's entries are all being read")
        off = self._alloc(need)
        if off is None:
            raise LedgerError(
                "staging_full",
                f"staging region has no free extent of {layout.total_bytes} bytes "
                f"(free {self.alloc.free_bytes}, largest {self.alloc.largest_free})",
            )
        exp = Export(transfer_id, off, self.alloc.size_of(off), layout, meta, now + ttl)
        exp.trailer = trailer
        exp.cached = cached
        self.exports[transfer_id] = exp
        if cached:
            self.cached[transfer_id] = exp.capacity
        return exp

    def commit_export(self, transfer_id: str, now: float, ttl: float) -> Export:
        exp = self._export(transfer_id)
        if exp.state != "reserved":
            raise LedgerError("bad_state", f"transfer {transfer_id} is already committed")
        exp.state = "ready"
        exp.expires_at = float("inf") if exp.cached else now + ttl
        return exp

    def ready_export(self, transfer_id: str) -> Export:
        exp = self.exports.get(transfer_id)
        if exp is None or exp.state != "ready" or exp.release_pending:
            raise LedgerError("unknown_transfer", f"unknown or expired transfer {transfer_id}")
        return exp

    def pin(self, transfer_id: str) -> Export:
        exp = self.ready_export(transfer_id)
        exp.pins += 1
        if exp.cached:  # a read is a use
            self.cached.move_to_end(transfer_id)
        return exp

    def unpin(self, transfer_id: str) -> Freed | None:
        exp = self._export(transfer_id)
        if exp.pins <= 0:
            raise LedgerError("bad_state", f"transfer {transfer_id} is not pinned")
        exp.pins -= 1
        if exp.pins == 0 and exp.release_pending:
            return self._free_export(exp, exp.release_pending)
        return None

    def release_export(self, transfer_id: str, reason: FreeReason) -> Freed | None:
        """Free now, or at the last unpin; -> what was freed now. A cached export stays after
        a pull (it is the tier's, not the puller's)."""
        exp = self._export(transfer_id)
        if exp.cached and exp.state == "ready" and reason == "pulled":
            return None
        if exp.pins:
            exp.release_pending = exp.release_pending or reason
            if self.retire is not None:
                self.retire(exp)
            return None
        return self._free_export(exp, reason)

    def _export(self, transfer_id: str) -> Export:
        try:
            return self.exports[transfer_id]
        except KeyError:
            raise LedgerError(
                "unknown_transfer", f"unknown or expired transfer {transfer_id}"
            ) from None

    def _free_export(self, exp: Export, reason: FreeReason) -> Freed:
        if self.retire is not None:
            self.retire(exp)
        del self.exports[exp.transfer_id]
        self.cached.pop(exp.transfer_id, None)
        self.alloc.free(exp.offset)
        return Freed("export", exp.transfer_id, reason, exp.capacity)

    # ---- imports ---------------------------------------------------------------------------

    def reserve_import(self, pull_id: str, nbytes: int) -> Import:
        if pull_id in self.imports:
            raise LedgerError("duplicate", f"pull {pull_id} already has an extent")
        off = self._alloc(nbytes)
        if off is None:
            raise LedgerError(
                "staging_full",
                f"staging region has no free extent of {nbytes} bytes "
                f"(free {self.alloc.free_bytes}, largest {self.alloc.largest_free})",
            )
        imp = Import(pull_id, off, self.alloc.size_of(off), nbytes)
        self.imports[pull_id] = imp
        return imp

    def complete_import(self, pull_id: str, now: float, ttl: float) -> Import:
        imp = self.imports[pull_id]
        imp.expires_at = now + ttl
        return imp

    def drop_import(self, pull_id: str, reason: FreeReason = "aborted") -> Freed | None:
        imp = self.imports.pop(pull_id, None)
        if imp is None:
            return None
        self.alloc.free(imp.offset)
        return Freed("import", pull_id, reason, imp.capacity)

    # ---- leases ----------------------------------------------------------------------------

    def sweep(self, now: float) -> list[Freed]:
        """Free every unpinned export and every completed import whose lease ran out (expiry
        is exclusive: a lease of ``t`` seconds granted at ``g`` is valid at ``g + t``)."""
        out: list[Freed] = []
        for exp in list(self.exports.values()):
            if exp.pins == 0 and now > exp.expires_at and not (exp.cached and exp.state == "ready"):
                out.append(self._free_export(exp, "expired"))
        for imp in list(self.imports.values()):
            if imp.expires_at is not None and now > imp.expires_at:
                freed = self.drop_import(imp.pull_id, "expired")
                assert freed is not None
                out.append(freed)
        return out

    def next_expiry(self) -> float | None:
        times = [e.expires_at for e in self.exports.values() if e.pins == 0 and not e.cached]
        times += [i.expires_at for i in self.imports.values() if i.expires_at is not None]
        return min(times, default=None)
