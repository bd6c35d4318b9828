from __future__ import annotations

import pytest

from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import BufferSpec, Layout
from dsv4_kvtransfer.ledger import Freed, Ledger, LedgerError

UNIT = 4096


def ledger(units: int = 16) -> Ledger:
    return Ledger(ExtentAllocator(UNIT, units * UNIT))


def layout(nbytes: int) -> Layout:
    return Layout.plan([BufferSpec("x", "uint8", (nbytes,))])


def test_export_lease_starts_at_reserve_and_restarts_at_commit() -> None:
    lg = ledger()
    exp = lg.reserve_export("t1", layout(5000), {}, now=100.0, ttl=30.0)
    assert (exp.offset, exp.capacity, exp.expires_at) == (UNIT, 2 * UNIT, 130.0)
    lg.commit_export("t1", now=110.0, ttl=30.0)
    assert exp.expires_at == 140.0 and exp.state == "ready"
    assert lg.sweep(140.0) == []  # valid at the expiry instant
    assert lg.next_expiry() == 140.0
    assert lg.sweep(140.001) == [Freed("export", "t1", "expired", 2 * UNIT)]
    assert lg.alloc.free_bytes == 16 * UNIT
    with pytest.raises(LedgerError) as e:
        lg.ready_export("t1")
    assert e.value.code == "unknown_transfer"


def test_uncommitted_exports_are_not_readable_and_expire_too() -> None:
    lg = ledger()
    lg.reserve_export("t1", layout(10), {}, now=0.0, ttl=5.0)
    with pytest.raises(LedgerError):
        lg.pin("t1")
    assert [f.reason for f in lg.sweep(5.5)] == ["expired"]
    assert lg.alloc.free_bytes == 16 * UNIT


def test_a_pinned_export_outlives_its_lease_and_release_waits_for_the_reader() -> None:
    lg = ledger()
    lg.reserve_export("t1", layout(10), {}, now=0.0, ttl=1.0)
    lg.commit_export("t1", now=0.0, ttl=1.0)
    lg.pin("t1")
    lg.pin("t1")
    assert lg.sweep(10.0) == []  # a reader is sending it
    assert lg.release_export("t1", "pulled") is None
    with pytest.raises(LedgerError):
        lg.pin("t1")  # released: no new readers
    assert lg.unpin("t1") is None
    assert lg.unpin("t1") == Freed("export", "t1", "pulled", UNIT)
    assert lg.alloc.free_bytes == 16 * UNIT


def test_unpinned_after_the_lease_the_next_sweep_frees_it() -> None:
    lg = ledger()
    lg.reserve_export("t1", layout(10), {}, now=0.0, ttl=1.0)
    lg.commit_export("t1", now=0.0, ttl=1.0)
    lg.pin("t1")
    assert lg.sweep(2.0) == []
    assert lg.unpin("t1") is None
    assert [f.key for f in lg.sweep(2.0)] == ["t1"]


def test_imports_get_a_lease_only_when_complete() -> None:
    lg = ledger(4)
    imp = lg.reserve_import("p1", 3 * UNIT)
    assert (imp.offset, imp.capacity) == (UNIT, 3 * UNIT)
    with pytest.raises(LedgerError) as e:
        lg.reserve_import("p2", 2 * UNIT)
    assert e.value.code == "staging_full" and "largest 4096" in str(e.value)
    assert lg.sweep(1e9) == []  # pending: the pull's own deadline bounds it
    lg.complete_import("p1", now=50.0, ttl=30.0)
    assert lg.sweep(80.0) == []
    assert lg.sweep(80.5) == [Freed("import", "p1", "expired", 3 * UNIT)]
    assert lg.drop_import("p1") is None
    assert lg.alloc.free_bytes == 4 * UNIT


def test_duplicate_and_unknown_ids() -> None:
    lg = ledger()
    lg.reserve_export("t1", layout(1), {}, 0.0, 1.0)
    with pytest.raises(LedgerError, match="already exists"):
        lg.reserve_export("t1", layout(1), {}, 0.0, 1.0)
    with pytest.raises(LedgerError, match="already committed"):
        lg.commit_export("t1", 0.0, 1.0)
        lg.commit_export("t1", 0.0, 1.0)
    with pytest.raises(LedgerError) as e:
        lg.release_export("nope", "aborted")
    assert e.value.code == "unknown_transfer"
