"""The staging store: every free, whoever causes it, is counted once by kind and reason, and the
gauges follow the ledger (clock injected, so leases run out exactly when the test says)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import BufferSpec, Layout
from dsv4_kvtransfer.ledger import Freed, Ledger, LedgerError
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.staging import HEADER_BYTES, StagingRegion
from dsv4_kvtransfer.store import StagingStore, Usage

SIZE = 64 << 10
DATA = SIZE - HEADER_BYTES
UNIT = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[StagingStore]:
    region = StagingRegion.create("store", SIZE, tmp_path)
    ledger = Ledger(ExtentAllocator(HEADER_BYTES, DATA))
    s = StagingStore(region, ledger, SidecarMetrics(), clock=clock)
    yield s
    region.close()


def layout(nbytes: int) -> Layout:
    return Layout.plan([BufferSpec("x", "uint8", (nbytes,))])


def sample(s: StagingStore, name: str, **labels: str) -> float:
    return s.metrics.registry.get_sample_value(name, labels) or 0.0


def gauges(s: StagingStore) -> tuple[float, float, float]:
    return (
        sample(s, "dsv4_kv_staging_free_bytes"),
        sample(s, "dsv4_kv_active_exports"),
        sample(s, "dsv4_kv_active_imports"),
    )


def test_reserving_and_committing_moves_the_gauges_and_restarts_the_lease(
    store: StagingStore, clock: Clock
) -> None:
    assert sample(store, "dsv4_kv_staging_bytes") == DATA
    assert gauges(store) == (DATA, 0, 0)
    exp = store.reserve_export("t1", layout(5000), {"lease_seconds": 10.0}, ttl=10.0)
    assert (exp.offset, exp.state, exp.expires_at) == (HEADER_BYTES, "reserved", 110.0)
    assert gauges(store) == (DATA - 2 * UNIT, 1, 0)
    assert sample(store, "dsv4_kv_exports_total") == 1
    clock.now = 105.0
    assert store.commit_export("t1", ttl=10.0).expires_at == 115.0
    assert store.usage() == Usage(DATA, DATA - 2 * UNIT, 2 * UNIT, DATA - 2 * UNIT, 1, 0)


def test_a_release_while_pinned_is_counted_once_at_the_last_unpin(store: StagingStore) -> None:
    store.reserve_export("t1", layout(100), {}, ttl=10.0)
    store.commit_export("t1", ttl=10.0)
    store.pin_export("t1")
    store.release_export("t1")
    assert sample(store, "dsv4_kv_released_total", kind="export", reason="pulled") == 0
    assert gauges(store) == (DATA - UNIT, 1, 0)
    store.unpin_export("t1")
    assert sample(store, "dsv4_kv_released_total", kind="export", reason="pulled") == 1
    assert gauges(store) == (DATA, 0, 0)
    with pytest.raises(LedgerError):
        store.ready_export("t1")


def test_leases_that_run_out_are_freed_and_counted_as_expiries(
    store: StagingStore, clock: Clock
) -> None:
    store.reserve_export("t1", layout(100), {}, ttl=10.0)
    store.reserve_import("p1", 5000)
    expires = store.complete_import("p1", ttl=20.0)
    assert expires == 120.0
    clock.now = 110.0
    assert store.sweep() == []  # valid at the expiry instant
    clock.now = 110.5
    assert store.sweep() == [Freed("export", "t1", "expired", UNIT)]
    clock.now = 120.5
    assert store.sweep() == [Freed("import", "p1", "expired", 2 * UNIT)]
    assert sample(store, "dsv4_kv_lease_expiries_total", kind="export") == 1
    assert sample(store, "dsv4_kv_lease_expiries_total", kind="import") == 1
    assert sample(store, "dsv4_kv_released_total", kind="import", reason="expired") == 1
    assert gauges(store) == (DATA, 0, 0)


def test_dropping_an_import_frees_it_once(store: StagingStore) -> None:
    store.reserve_import("p1", 100)
    assert gauges(store) == (DATA - UNIT, 0, 1)
    assert store.drop_import("p1", "aborted") is True
    assert store.drop_import("p1", "aborted") is False
    assert sample(store, "dsv4_kv_released_total", kind="import", reason="aborted") == 1
    assert gauges(store) == (DATA, 0, 0)


def test_aborting_an_export_frees_it_and_an_unknown_one_is_refused(store: StagingStore) -> None:
    store.reserve_export("t1", layout(100), {}, ttl=10.0)
    assert store.abort_export("t1") is True
    assert sample(store, "dsv4_kv_released_total", kind="export", reason="aborted") == 1
    assert store.export("t1") is None
    with pytest.raises(LedgerError) as e:
        store.abort_export("t1")
    assert e.value.code == "unknown_transfer"


def test_host_tier_entries_are_not_exports_and_their_evictions_are_counted(
    store: StagingStore,
) -> None:
    store.ledger.host_bytes = 3 * UNIT
    for tid in ("a", "b"):
        store.reserve_export(tid, layout(UNIT), {}, ttl=30.0, cached=True)
        store.commit_export(tid, ttl=30.0)
    store.reserve_export("pd", layout(UNIT), {}, ttl=30.0)
    u = store.usage()
    assert (u.exports, u.cached_entries, u.cached_bytes) == (1, 2, 2 * UNIT)
    assert sample(store, "dsv4_kv_active_exports") == 1
    assert sample(store, "dsv4_kv_host_tier_bytes") == 2 * UNIT
    store.reserve_export("c", layout(2 * UNIT), {}, ttl=30.0, cached=True)  # a goes
    assert sample(store, "dsv4_kv_released_total", kind="export", reason="evicted") == 1
    assert list(store.ledger.cached) == ["b", "c"]
    store.release_export("b")  # a pull's RELEASE: the tier keeps it
    assert store.usage().cached_entries == 2
