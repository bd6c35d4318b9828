"""The layout fingerprint and the per-buffer checksums (``dsv4_kvtransfer.integrity``)."""

from __future__ import annotations

import dataclasses
import json
import time
import zlib

import pytest

from dsv4_kvtransfer.buffers import BufferSpec, Layout
from dsv4_kvtransfer.integrity import (
    CHECKSUM_MISMATCH,
    FINGERPRINT_MISMATCH,
    Fingerprint,
    IntegrityError,
    IntegrityRecord,
    ParallelLayout,
    buffer_checksums,
    cache_group_digests,
    check_fingerprint,
    checksum,
    config_hash,
    verify_landed,
)

pytestmark = pytest.mark.unit

ROWS = [
    ("layers.0.comp", "comp4", "bfloat16", (32, 512)),
    ("layers.0.index", "index", "bfloat16", (32, 128)),
    ("layers.0.window", "window", "bfloat16", (129, 512)),
]


def fp(**kw: object) -> Fingerprint:
    base = Fingerprint("DeepseekV4ForCausalLM", "bfloat16", 128, cache_group_digests(ROWS))
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def layout() -> Layout:
    return Layout.plan(
        [BufferSpec("a", "uint8", (3, 100), "comp4"), BufferSpec("b", "float32", (10,), "state")]
    )


def test_fingerprint_digest_is_stable_and_round_trips() -> None:
    a = fp(revision="abc")
    assert a.digest == fp(revision="abc").digest
    assert len(a.digest) == 32
    d = a.to_dict()
    assert d["v"] == 1 and d["digest"] == a.digest
    assert d["parallel"] == {"tp": [0, 1], "cp": [0, 1]}
    back = Fingerprint.from_dict(json.loads(json.dumps(d)))
    assert back == a and back.digest == a.digest
    # groups in another order are the same groups
    assert cache_group_digests(reversed(ROWS)) == cache_group_digests(ROWS)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "DeepseekV3ForCausalLM"),
        ("dtype", "float32"),
        ("block_size", 64),
        (
            "cache_groups",
            cache_group_digests([*ROWS[:2], ("layers.0.window", "window", "bfloat16", (130, 512))]),
        ),
        (
            "cache_groups",
            cache_group_digests([*ROWS, ("layers.1.comp", "comp4", "bfloat16", (32, 512))]),
        ),
        ("parallel", ParallelLayout(tp_rank=1, tp_size=2)),
        ("parallel", ParallelLayout(cp_rank=0, cp_size=2)),
        ("revision", "other"),
    ],
)
def test_every_field_changes_the_fingerprint(field: str, value: object) -> None:
    a, b = fp(), fp(**{field: value})
    assert a.digest != b.digest
    assert a.diff(b) == [field]
    with pytest.raises(IntegrityError) as e:
        check_fingerprint(IntegrityRecord({}, b), a)
    assert e.value.reason == FINGERPRINT_MISMATCH
    assert field in str(e.value)


def test_fingerprint_check() -> None:
    check_fingerprint(IntegrityRecord({}, fp()), fp())
    check_fingerprint(None, None)  # nothing expected: anything goes
    check_fingerprint(IntegrityRecord({}, None), None)
    for rec in (None, IntegrityRecord({}, None)):  # expected, but the export names none
        with pytest.raises(IntegrityError, match="no layout fingerprint") as e:
            check_fingerprint(rec, fp())
        assert e.value.reason == FINGERPRINT_MISMATCH


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"v": 2},
        {**fp().to_dict(), "v": True},
        {**fp().to_dict(), "digest": "0" * 32},  # fields changed behind the digest
        {k: v for k, v in fp().to_dict().items() if k != "revision"},
        {**fp().to_dict(), "block_size": 0},
        {**fp().to_dict(), "parallel": {"tp": [2, 2], "cp": [0, 1]}},
        {**fp().to_dict(), "parallel": {"tp": [0, 1]}},
    ],
)
def test_malformed_fingerprints_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Fingerprint.from_dict(bad)


def test_config_hash() -> None:
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    assert len(config_hash({})) == 16


def test_checksum_is_crc32_in_hex() -> None:
    assert checksum(b"") == "00000000"
    assert checksum(b"123456789") == "cbf43926"  # CRC-32's check value
    assert checksum(memoryview(b"123456789")) == f"{zlib.crc32(b'123456789'):08x}"


def test_checksums_per_buffer_and_a_flipped_byte() -> None:
    lay = layout()
    data = bytearray(lay.total_bytes)
    for i in range(len(data)):
        data[i] = i % 251
    ext = memoryview(data)
    sums = buffer_checksums(lay, ext)
    assert list(sums) == ["a", "b"]
    b = lay.get("b")
    assert sums["a"] == checksum(bytes(data[:300]))
    assert sums["b"] == checksum(bytes(data[b.offset : b.offset + 40]))
    rec = IntegrityRecord(sums, fp())
    meta = {"integrity": rec.to_dict()}
    verify_landed(meta, lay, ext, fp())
    # the bytes between buffers (alignment padding) are not KV: not covered
    data[300] ^= 0xFF
    verify_landed(meta, lay, ext, fp())
    for at, name in ((0, "a"), (299, "a"), (b.offset + 39, "b")):
        data[at] ^= 0x01
        with pytest.raises(IntegrityError, match=f"KV buffer {name}") as e:
            verify_landed(meta, lay, ext, fp())
        assert e.value.reason == CHECKSUM_MISMATCH
        data[at] ^= 0x01
    verify_landed(meta, lay, ext, fp())
    with pytest.raises(IntegrityError) as e:
        verify_landed(meta, lay, ext, fp(revision="r2"))
    assert e.value.reason == FINGERPRINT_MISMATCH


def test_record_json_length_does_not_depend_on_the_sums() -> None:
    lay = layout()
    ext = memoryview(bytearray(b"\x07" * lay.total_bytes))
    real = IntegrityRecord(buffer_checksums(lay, ext), fp())
    zero = IntegrityRecord.placeholder(lay, fp())
    assert zero.checksums == {"a": "00000000", "b": "00000000"}
    assert len(json.dumps(real.to_dict())) == len(json.dumps(zero.to_dict()))
    back = IntegrityRecord.from_meta(json.loads(json.dumps({"integrity": real.to_dict()})))
    assert back == real


def test_records_this_version_cannot_read() -> None:
    assert IntegrityRecord.from_meta({}) is None
    verify_landed({}, layout(), memoryview(bytearray(layout().total_bytes)), None)
    good = IntegrityRecord({"a": "0" * 8, "b": "0" * 8}, None).to_dict()
    for bad in (
        {**good, "v": 9},
        {**good, "algo": "md5"},
        {**good, "checksums": {"a": "123"}},
        {**good, "fingerprint": {"v": 1}},
    ):
        with pytest.raises(IntegrityError) as e:
            IntegrityRecord.from_meta({"integrity": bad})
        assert e.value.reason == CHECKSUM_MISMATCH
    rec = IntegrityRecord({"a": "0" * 8}, None)  # names other buffers than the layout's
    with pytest.raises(IntegrityError, match="do not name its buffers"):
        rec.verify(layout(), memoryview(bytearray(layout().total_bytes)))


def test_checksum_cost_of_one_mib() -> None:
    """The cost the export's commit and a pull pay per MiB (bounded loosely: a busy host)."""
    block = memoryview(bytes(range(256)) * 4096)
    checksum(block)
    t = time.perf_counter()
    for _ in range(20):
        checksum(block)
    per_mib = (time.perf_counter() - t) / 20
    assert per_mib < 0.02, f"{per_mib * 1e3:.2f} ms per MiB"
