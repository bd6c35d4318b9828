"""The sidecar's host tier in the ledger: cached exports keep no lease, survive their pulls and
are evicted least recently used, by the tier's byte cap or when an export or an import finds no
free extent. Exact extents and byte counts."""

from __future__ import annotations

import pytest

from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import BufferSpec, Layout
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.control_requests import ExportRequest
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.ledger import Freed, Ledger, LedgerError

UNIT = 4096


def ledger(units: int = 16, host_units: int = 8) -> Ledger:
    lg = Ledger(ExtentAllocator(UNIT, units * UNIT))
    lg.host_bytes = host_units * UNIT
    return lg


def layout(units: int) -> Layout:
    return Layout.plan([BufferSpec("x", "uint8", (units * UNIT,))])


def offer(lg: Ledger, tid: str, units: int, now: float = 0.0) -> None:
    lg.reserve_export(tid, layout(units), {}, now=now, ttl=30.0, cached=True)
    lg.commit_export(tid, now=now, ttl=30.0)


def test_a_cached_export_has_no_lease_and_stays_after_a_pull() -> None:
    lg = ledger()
    offer(lg, "a", 2)
    assert lg.cached_bytes == 2 * UNIT and list(lg.cached) == ["a"]
    assert lg.sweep(1e9) == [] and lg.next_expiry() is None
    lg.pin("a")
    assert lg.release_export("a", "pulled") is None  # the tier's, not the puller's
    assert lg.unpin("a") is None
    assert lg.ready_export("a").pins == 0 and lg.cached_bytes == 2 * UNIT
    # the engine that offered it may still abort it (a failed copy)
    assert lg.release_export("a", "aborted") == Freed("export", "a", "aborted", 2 * UNIT)
    assert lg.cached_bytes == 0 and lg.alloc.free_bytes == 16 * UNIT


def test_an_uncommitted_offer_expires_like_any_reservation() -> None:
    lg = ledger()
    lg.reserve_export("a", layout(1), {}, now=0.0, ttl=5.0, cached=True)
    assert lg.sweep(5.5) == [Freed("export", "a", "expired", UNIT)]
    assert lg.cached_bytes == 0


def test_the_byte_cap_evicts_least_recently_used_and_a_read_is_a_use() -> None:
    lg = ledger(host_units=6)
    offer(lg, "a", 2)
    offer(lg, "b", 2)
    offer(lg, "c", 2)
    lg.pin("a")  # read: now the most recently used
    lg.unpin("a")
    offer(lg, "d", 2)  # 8 units > 6: b goes
    assert list(lg.cached) == ["c", "a", "d"]
    assert lg.take_evicted() == [Freed("export", "b", "evicted", 2 * UNIT)]
    assert lg.take_evicted() == []
    assert lg.cached_bytes == 6 * UNIT and lg.alloc.free_bytes == 10 * UNIT


def test_a_pinned_entry_is_not_evicted_and_a_full_tier_refuses() -> None:
    lg = ledger(host_units=4)
    offer(lg, "a", 2)
    offer(lg, "b", 2)
    lg.pin("a")
    lg.pin("b")
    with pytest.raises(LedgerError) as e:
        offer(lg, "c", 2)
    assert e.value.code == "staging_full" and lg.take_evicted() == []
    lg.unpin("b")
    offer(lg, "c", 2)
    assert lg.take_evicted() == [Freed("export", "b", "evicted", 2 * UNIT)]
    assert list(lg.cached) == ["a", "c"]


def test_duplicates_refresh_and_oversize_or_no_tier_is_refused() -> None:
    lg = ledger(host_units=4)
    offer(lg, "a", 1)
    offer(lg, "b", 1)
    with pytest.raises(LedgerError) as e:
        offer(lg, "a", 1)
    assert e.value.code == "duplicate" and list(lg.cached) == ["b", "a"]
    with pytest.raises(LedgerError) as e:
        offer(lg, "big", 5)
    assert e.value.code == "no_host_tier"
    off = ledger(host_units=0)
    with pytest.raises(LedgerError) as e:
        offer(off, "a", 1)
    assert e.value.code == "no_host_tier"


def test_exports_and_imports_take_the_tiers_room_when_the_region_is_full() -> None:
    lg = ledger(units=8, host_units=8)
    offer(lg, "a", 3)
    offer(lg, "b", 3)
    assert lg.alloc.free_bytes == 2 * UNIT
    lg.reserve_export("pd", layout(3), {}, now=0.0, ttl=30.0)  # an ordinary export comes first
    assert lg.take_evicted() == [Freed("export", "a", "evicted", 3 * UNIT)]
    lg.reserve_import("p1", 4 * UNIT)
    assert lg.take_evicted() == [Freed("export", "b", "evicted", 3 * UNIT)]
    assert lg.cached_bytes == 0 and lg.alloc.free_bytes == UNIT
    with pytest.raises(LedgerError) as e:  # nothing left to evict
        lg.reserve_import("p2", 2 * UNIT)
    assert e.value.code == "staging_full"


def test_the_tier_fits_the_region_and_an_offer_names_a_well_formed_key() -> None:
    with pytest.raises(ValueError, match="kv_host_bytes must be in"):
        SidecarConfig(token=b"t", staging_bytes=1 << 20, kv_host_bytes=2 << 20)
    buf = {"name": "x", "dtype": "uint8", "shape": [16]}
    key = "ab" * 32
    assert (
        ExportRequest.from_body({"request_id": "r", "buffers": [buf], "prefix_key": key}).prefix_key
        == key
    )
    with pytest.raises(ApiError) as e:
        ExportRequest.from_body({"request_id": "r", "buffers": [buf], "prefix_key": "AB" * 32})
    assert e.value.param == "prefix_key"
