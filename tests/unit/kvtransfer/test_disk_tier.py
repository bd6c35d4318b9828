"""The sidecar's disk tier: LRU accounting by file bytes, file names, the file format's checks
(a stale fingerprint, a corrupted buffer, a truncated or foreign file: each dropped and counted,
never used), spills from the host tier's LRU and reads back into it, and the settings' checks.
Exact byte counts and reasons."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsv4_kvtransfer import disk_files
from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import BufferSpec, Layout
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.disk_tier import DiskIndex, DiskTier, DiskTierError
from dsv4_kvtransfer.integrity import (
    CHECKSUM_MISMATCH,
    FINGERPRINT_MISMATCH,
    Fingerprint,
    IntegrityError,
    IntegrityRecord,
    buffer_checksums,
)
from dsv4_kvtransfer.ledger import Ledger
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.staging import HEADER_BYTES, StagingRegion
from dsv4_kvtransfer.store import StagingStore

pytestmark = pytest.mark.unit

UNIT = 4096
LAYOUT = Layout.plan([BufferSpec("a", "uint8", (UNIT,)), BufferSpec("b", "uint8", (UNIT,))])
FP = Fingerprint("dsv4-tiny", "bfloat16", 16, {"window": "abc"})


def data(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(LAYOUT.total_bytes))


def meta_of(raw: bytes, fp: Fingerprint | None = FP) -> dict[str, object]:
    record = IntegrityRecord(buffer_checksums(LAYOUT, memoryview(raw)), fp)
    return {"num_tokens": 32, "integrity": record.to_dict()}


def drops(m: SidecarMetrics, reason: str) -> float:
    return m.registry.get_sample_value("dsv4_kv_disk_tier_drops_total", {"reason": reason}) or 0


# ---- the index ------------------------------------------------------------------------------


def test_the_index_drops_the_least_recently_spilled_for_room() -> None:
    ix = DiskIndex(cap=10)
    assert ix.admit("a", 4) == [] and ix.admit("b", 4) == []
    assert ix.admit("c", 4) == ["a"]
    assert (list(ix.entries), ix.used) == (["b", "c"], 8)
    assert ix.admit("d", 9) == ["b", "c"] and ix.used == 9
    assert ix.admit("e", 11) is None and ix.used == 9  # never fits: nothing dropped
    assert ix.admit("d", 3) == ["d"] and (list(ix.entries), ix.used) == (["d"], 3)
    assert ix.remove("d") == 3 and ix.remove("d") is None and ix.used == 0


def test_file_names_are_per_spill_and_only_for_safe_ids() -> None:
    assert disk_files.file_name("0af3" * 6, 7) == "0af30af30af30af30af30af3.7.kv"
    assert disk_files.file_name("../etc", 1) is None
    assert disk_files.file_name("", 1) is None
    assert disk_files.file_name("x" * 65, 1) is None
    assert disk_files.is_ours("a.1.kv") and disk_files.is_ours("a.1.kv.tmp")
    assert not disk_files.is_ours("notes.txt")


# ---- the file format's checks ----------------------------------------------------------------


def _file(tid: str, raw: bytes, fp: Fingerprint | None = FP) -> tuple[bytes, disk_files.Stamp]:
    meta = meta_of(raw, fp)
    st = disk_files.stamp(LAYOUT, meta, raw)
    head = disk_files.encode_head(tid, meta, st)
    assert disk_files.file_bytes(tid, LAYOUT, meta, st) == len(head) + LAYOUT.total_bytes
    return head + raw, st


def test_a_file_reads_back_exact() -> None:
    raw = data(1)
    blob, st = _file("t1", raw)
    assert st.fingerprint == FP.digest
    assert st.checksums == buffer_checksums(LAYOUT, memoryview(raw))
    meta, got = disk_files.decode(blob, "t1", st)
    assert bytes(got) == raw and meta == meta_of(raw)


def test_a_corrupted_buffer_is_a_checksum_mismatch() -> None:
    blob, st = _file("t1", data(1))
    bad = bytearray(blob)
    bad[-1] ^= 0xFF  # the last byte of buffer b
    with pytest.raises(IntegrityError, match="buffer b is not what was spilled") as e:
        disk_files.decode(bytes(bad), "t1", st)
    assert e.value.reason == CHECKSUM_MISMATCH


def test_a_file_of_another_layout_fingerprint_is_stale() -> None:
    _, st = _file("t1", data(1))
    other = Fingerprint("dsv4-tiny", "float8_e4m3fn", 16, {"window": "abc"})
    stale, _ = _file("t1", data(1), other)
    with pytest.raises(IntegrityError, match="a stale file") as e:
        disk_files.decode(stale, "t1", st)
    assert e.value.reason == FINGERPRINT_MISMATCH


@pytest.mark.parametrize(
    ("mangle", "match"),
    [
        (lambda b: b[:5], "truncated header"),
        (lambda b: b"NOTOURS!" + b[8:], "not a disk-tier file"),
        (lambda b: b[:-1], f"{2 * UNIT - 1} of {2 * UNIT} bytes"),
    ],
)
def test_a_truncated_or_foreign_file_is_a_read_error(mangle, match: str) -> None:  # type: ignore[no-untyped-def]
    blob, st = _file("t1", data(1))
    with pytest.raises(IntegrityError, match=match) as e:
        disk_files.decode(mangle(blob), "t1", st)
    assert e.value.reason == disk_files.READ_ERROR


def test_a_file_of_another_entry_is_refused() -> None:
    blob, st = _file("t2", data(1))
    with pytest.raises(IntegrityError, match="the file is entry 't2''s") as e:
        disk_files.decode(blob, "t1", st)
    assert e.value.reason == disk_files.READ_ERROR


# ---- the tier --------------------------------------------------------------------------------


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[tuple[DiskTier, list[str]]]:
    gone: list[str] = []
    entry = len(
        disk_files.encode_head(
            "t0", meta_of(data(0)), disk_files.stamp(LAYOUT, meta_of(data(0)), data(0))
        )
    )
    t = DiskTier(
        str(tmp_path / "disk"), 2 * (entry + LAYOUT.total_bytes), SidecarMetrics(), gone.extend
    )
    t.open()
    yield t, gone
    t.close()


def test_spills_are_written_once_and_read_back_exact(tier: tuple[DiskTier, list[str]]) -> None:
    t, gone = tier
    for k in range(3):
        assert t.spill(f"t{k}", LAYOUT, meta_of(data(k)), data(k))
    t.flush()
    assert gone == ["t0"]  # the cap holds two: the least recently spilled went
    assert sorted(os.listdir(t.directory)) == ["t1.2.kv", "t2.3.kv"]
    got = t.take("t1")
    assert got is not None and bytes(got[2]) == data(1) and got[1] == meta_of(data(1))
    assert os.listdir(t.directory) == ["t2.3.kv"] and "t1" not in t
    assert t.take("t1") is None
    m = t.metrics.registry.get_sample_value
    assert m("dsv4_kv_disk_tier_spills_total") == 3 and m("dsv4_kv_disk_tier_hits_total") == 1
    assert drops(t.metrics, "evicted") == 1 and m("dsv4_kv_disk_tier_entries") == 1


def test_a_corrupted_file_is_dropped_counted_and_announced(
    tier: tuple[DiskTier, list[str]],
) -> None:
    t, gone = tier
    t.spill("t1", LAYOUT, meta_of(data(1)), data(1))
    t.flush()
    path = os.path.join(t.directory, "t1.1.kv")
    with open(path, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\x00" * 10)
    assert t.take("t1") is None
    assert drops(t.metrics, CHECKSUM_MISMATCH) == 1 and gone == ["t1"]
    assert os.listdir(t.directory) == [] and t.usage() == (0, 0)


def test_a_write_error_drops_the_entry_and_counts_it(tier: tuple[DiskTier, list[str]]) -> None:
    t, gone = tier
    os.rmdir(t.directory)  # (empty) the writes now fail, as on a full or gone disk
    assert t.spill("t1", LAYOUT, meta_of(data(1)), data(1))
    t.flush()
    assert drops(t.metrics, "write_error") == 1 and gone == ["t1"] and t.usage() == (0, 0)


def test_an_entry_larger_than_the_cap_is_not_taken(tmp_path: Path) -> None:
    t = DiskTier(str(tmp_path), LAYOUT.total_bytes, SidecarMetrics())
    t.open()
    assert not t.spill("t1", LAYOUT, meta_of(data(1)), data(1))
    assert drops(t.metrics, "not_taken") == 1 and t.usage() == (0, 0)
    t.close()


def test_open_empties_the_tiers_files_only_and_refuses_an_unwritable_dir(tmp_path: Path) -> None:
    for name in ("old.1.kv", "old.2.kv.tmp", "keep.txt"):
        (tmp_path / name).write_bytes(b"x")
    t = DiskTier(str(tmp_path), 1 << 20, SidecarMetrics())
    t.open()
    t.close()
    assert os.listdir(tmp_path) == ["keep.txt"]
    with pytest.raises(DiskTierError, match=r"--kv-disk-dir .*keep.txt/d: not a writable"):
        DiskTier(str(tmp_path / "keep.txt" / "d"), 1 << 20, SidecarMetrics()).open()


# ---- the store: the host tier's LRU spills, a read brings it back ---------------------------


def test_the_host_tier_spills_to_disk_and_a_pull_brings_the_entry_back(tmp_path: Path) -> None:
    region = StagingRegion.create("region", HEADER_BYTES + 64 * UNIT, tmp_path)
    ledger = Ledger(ExtentAllocator(HEADER_BYTES, 64 * UNIT))
    ledger.host_bytes = 4 * UNIT  # two entries
    store = StagingStore(region, ledger, SidecarMetrics())
    disk = DiskTier(str(tmp_path / "disk"), 1 << 20, store.metrics)
    disk.open()
    store.attach_disk(disk)
    try:
        for k in range(3):
            v = store.reserve_export(f"t{k}", LAYOUT, meta_of(data(k)), 30.0, cached=True)
            region.view(v.offset, LAYOUT.total_bytes)[:] = data(k)
            store.commit_export(f"t{k}", 30.0)
        assert list(ledger.cached) == ["t1", "t2"] and "t0" in disk
        assert store.host_evictions.since(0).transfer_ids == []  # still here: not announced
        exp = store.pin_export("t0")  # a pull: back into the host tier (t1 spills for it)
        assert bytes(region.view(exp.offset, LAYOUT.total_bytes)) == data(0)
        assert exp.meta == meta_of(data(0)) and list(ledger.cached) == ["t2", "t0"]
        assert "t1" in disk and "t0" not in disk
        store.unpin_export("t0")
        m = store.metrics.registry.get_sample_value
        assert m("dsv4_kv_released_total", {"kind": "export", "reason": "spilled"}) == 2
        assert m("dsv4_kv_disk_tier_hits_total") == 1
    finally:
        disk.close()
        region.close()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_disk_bytes": -1}, "--kv-disk-bytes must be 0 (off) or at least 1M, not -1"),
        ({"kv_disk_bytes": 1000}, "--kv-disk-bytes must be 0 (off) or at least 1M, not 1000"),
        ({"kv_disk_bytes": 1 << 20, "kv_disk_dir": "/d"}, "--kv-disk-bytes needs --kv-host-bytes"),
        ({"kv_disk_bytes": 1 << 20, "kv_host_bytes": 1 << 20}, "needs --kv-disk-dir"),
        ({"kv_disk_dir": "/d"}, "--kv-disk-dir without --kv-disk-bytes"),
    ],
)
def test_bad_disk_tier_settings_are_refused_naming_the_flag(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SidecarConfig(token=b"t", **settings)  # type: ignore[arg-type]
