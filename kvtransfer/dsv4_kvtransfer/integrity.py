"""What makes pulled KV trustworthy: the layout fingerprint of the engine that wrote it and a
checksum of every buffer. Pure: the sidecar, the engine's client and the engine use it.

**Fingerprint.** Two engines' KV is interchangeable only if it means the same thing: the same
model (architecture), KV dtype, tokens per block, the same cache groups with the same per-row
shapes (ring lengths, MTP lookahead and compression ratios show there), the same slice of the
model's KV along each parallel axis, and the same weights (``revision``: the checkpoint's
revision, by default a hash of the model's config). ``Fingerprint.digest`` is a hash of all of
it; ``diff`` names the fields that differ, for the log.

**Checksums.** One CRC-32 per named buffer of an export (zlib's: ~7 GB/s on one core here, a
few times a memory copy's cost; stdlib only), as 8 hex digits, so a record's JSON has the same
length whatever the values (the sidecar sizes an export's trailer before the bytes exist:
``IntegrityRecord.placeholder``).

An ``IntegrityRecord`` (versioned) travels in an export's manifest (``meta["integrity"]``); a
puller checks the fingerprint as soon as it has the manifest (before a byte moves) and the
checksums once the bytes landed, before anyone may read them. Either mismatch raises
``IntegrityError`` whose ``reason`` (``fingerprint_mismatch`` / ``checksum_mismatch``) is the
pull's failure reason.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4_kvtransfer.buffers import Layout

VERSION = 1
ALGO = "crc32"
META_KEY = "integrity"
FINGERPRINT_MISMATCH = "fingerprint_mismatch"
CHECKSUM_MISMATCH = "checksum_mismatch"
_ZERO = "0" * 8


class IntegrityError(ValueError):
    """Pulled KV that must not be used; ``reason`` is the pull's failure reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _digest(obj: object, n: int = 32) -> str:
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:n]


def config_hash(config: Mapping[str, Any]) -> str:
    """A model config's hash: the default ``revision`` (same config.json, same hash)."""
    return _digest(config, 16)


def cache_group_digests(rows: Iterable[tuple[str, str, str, tuple[int, ...]]]) -> dict[str, str]:
    """``{group: digest}`` of ``(name, group, dtype, row shape)`` per cache tensor, where the row
    shape is one block's (paged) or one slot's (state): independent of how many blocks an
    export holds, and small enough for every manifest (a model has a few groups, not a few
    hundred tensors)."""
    groups: dict[str, list[tuple[str, str, list[int]]]] = {}
    for name, group, dtype, shape in rows:
        groups.setdefault(group, []).append((name, dtype, list(shape)))
    return {g: _digest(sorted(items), 12) for g, items in sorted(groups.items())}


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """Which slice of the model's KV an export holds along each parallel axis: ``(rank,
    size)`` of its shard over TP and CP. KV replicated over an axis is exported whole along it,
    ``(0, 1)``. DP does not shard a request's KV (each DP rank holds whole requests), so it is
    not part of it: a decode on DP rank 0 may use what DP rank 1 of a prefill exported."""

    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        for r, s, axis in ((self.tp_rank, self.tp_size, "tp"), (self.cp_rank, self.cp_size, "cp")):
            if not (_int(r) and _int(s) and 0 <= r < s):
                raise ValueError(f"parallel layout {axis}: rank {r!r} of size {s!r}")

    def to_dict(self) -> dict[str, list[int]]:
        return {"tp": [self.tp_rank, self.tp_size], "cp": [self.cp_rank, self.cp_size]}

    @classmethod
    def from_dict(cls, d: object) -> ParallelLayout:
        if not isinstance(d, Mapping) or set(d) != {"tp", "cp"}:
            raise ValueError("parallel must be {tp: [rank, size], cp: [rank, size]}")
        tp, cp = d["tp"], d["cp"]
        if not (isinstance(tp, list) and isinstance(cp, list) and len(tp) == len(cp) == 2):
            raise ValueError("parallel must be {tp: [rank, size], cp: [rank, size]}")
        return cls(tp[0], tp[1], cp[0], cp[1])


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _version(d: Mapping[str, Any]) -> bool:
    v = d.get("v")
    return _int(v) and v == VERSION


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """An engine's KV layout, as a puller compares it with its own."""

    model: str
    dtype: str
    block_size: int
    cache_groups: Mapping[str, str]
    """``cache_group_digests`` of the engine's cache tensors."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    revision: str = ""

    FIELDS = ("model", "dtype", "block_size", "cache_groups", "parallel", "revision")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not isinstance(self.dtype, str):
            raise ValueError("fingerprint model and dtype must be strings")
        if not _int(self.block_size) or self.block_size <= 0:
            raise ValueError(f"fingerprint block_size must be > 0, got {self.block_size!r}")
        if not isinstance(self.cache_groups, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.cache_groups.items()
        ):
            raise ValueError("fingerprint cache_groups must map group names to digests")
        if not isinstance(self.revision, str) or len(self.revision) > 256:
            raise ValueError("fingerprint revision must be a string of at most 256 characters")

    def _fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "cache_groups": dict(sorted(self.cache_groups.items())),
            "parallel": self.parallel.to_dict(),
            "revision": self.revision,
        }

    @property
    def digest(self) -> str:
        return _digest(self._fields())

    def to_dict(self) -> dict[str, Any]:
        return {"v": VERSION, **self._fields(), "digest": self.digest}

    @classmethod
    def from_dict(cls, d: object) -> Fingerprint:
        """``ValueError`` for anything but a fingerprint of this version."""
        if not isinstance(d, Mapping) or not _version(d):
            raise ValueError(f"not a version-{VERSION} fingerprint")
        missing = [f for f in cls.FIELDS if f not in d]
        if missing:
            raise ValueError(f"fingerprint without {', '.join(missing)}")
        fp = cls(
            d["model"],
            d["dtype"],
            d["block_size"],
            dict(d["cache_groups"]) if isinstance(d["cache_groups"], Mapping) else {},
            ParallelLayout.from_dict(d["parallel"]),
            d["revision"],
        )
        if d.get("digest", fp.digest) != fp.digest:
            raise ValueError("fingerprint digest does not match its fields")
        return fp

    def diff(self, other: Fingerprint) -> list[str]:
        a, b = self._fields(), other._fields()
        return [f for f in self.FIELDS if a[f] != b[f]]


def checksum(data: memoryview | bytes) -> str:
    """One buffer's CRC-32 as 8 hex digits (zlib releases the GIL for it)."""
    return f"{zlib.crc32(data):08x}"


def buffer_checksums(layout: Layout, extent: memoryview) -> dict[str, str]:
    """``{buffer name: checksum}`` of an extent laid out as ``layout``, in layout order."""
    return {
        b.spec.name: checksum(extent[b.offset : b.offset + b.spec.nbytes]) for b in layout.buffers
    }


@dataclass(frozen=True, slots=True)
class IntegrityRecord:
    """What an export carries in its manifest: the writer's fingerprint (None: the writer
    named none) and a checksum per buffer."""

    checksums: Mapping[str, str]
    fingerprint: Fingerprint | None = None

    @classmethod
    def placeholder(cls, layout: Layout, fingerprint: Fingerprint | None) -> IntegrityRecord:
        """Zeros where the checksums go: as long as the real record, as JSON."""
        return cls({b.spec.name: _ZERO for b in layout.buffers}, fingerprint)

    def to_dict(self) -> dict[str, Any]:
        fp = self.fingerprint.to_dict() if self.fingerprint is not None else None
        return {"v": VERSION, "algo": ALGO, "fingerprint": fp, "checksums": dict(self.checksums)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> IntegrityRecord | None:
        """The record in a manifest's meta (None: the writer made none); ``IntegrityError``
        for one this version cannot read."""
        d = meta.get(META_KEY)
        if d is None:
            return None
        try:
            if not isinstance(d, Mapping) or not _version(d) or d.get("algo") != ALGO:
                raise ValueError(f"not a version-{VERSION} {ALGO} record")
            sums = d.get("checksums")
            if not isinstance(sums, Mapping) or not all(
                isinstance(v, str) and len(v) == 8 for v in sums.values()
            ):
                raise ValueError("checksums must map buffer names to 8 hex digits")
            raw = d.get("fingerprint")
            fp = Fingerprint.from_dict(raw) if raw is not None else None
        except (ValueError, TypeError) as e:
            raise IntegrityError(CHECKSUM_MISMATCH, f"the export's integrity record: {e}") from e
        return cls(dict(sums), fp)

    def verify(self, layout: Layout, extent: memoryview) -> None:
        """``IntegrityError`` naming the first buffer whose bytes are not what was written."""
        if set(self.checksums) != {b.spec.name for b in layout.buffers}:
            raise IntegrityError(
                CHECKSUM_MISMATCH, "the export's checksums do not name its buffers"
            )
        for b in layout.buffers:
            got = checksum(extent[b.offset : b.offset + b.spec.nbytes])
            if got != self.checksums[b.spec.name]:
                raise IntegrityError(
                    CHECKSUM_MISMATCH,
                    f"KV buffer {b.spec.name}: {ALGO} {got}, written as "
                    f"{self.checksums[b.spec.name]}: corrupted on the way, not used",
                )


def check_fingerprint(record: IntegrityRecord | None, expected: Fingerprint | None) -> None:
    """The fingerprint check of a manifest's record (None: the export has none)."""
    if expected is None:
        return
    theirs = record.fingerprint if record is not None else None
    if theirs is None:
        raise IntegrityError(
            FINGERPRINT_MISMATCH, "the export carries no layout fingerprint: not used"
        )
    if theirs.digest != expected.digest:
        fields = theirs.diff(expected)
        detail = ", ".join(
            f"{f} {getattr(theirs, f)!r} vs {getattr(expected, f)!r}" for f in fields
        )
        raise IntegrityError(
            FINGERPRINT_MISMATCH,
            f"the export's KV layout is not this engine's ({detail or 'digest'}): not used",
        )


def verify_landed(
    meta: Mapping[str, Any], layout: Layout, extent: memoryview, expected: Fingerprint | None
) -> None:
    """Everything a puller checks once the bytes landed: the fingerprint (again: cheap) and
    every checksum. An export without a record passes unless a fingerprint is expected."""
    record = IntegrityRecord.from_meta(meta)
    check_fingerprint(record, expected)
    if record is not None:
        record.verify(layout, extent)
