"""One disk-tier entry as a file: its name, its bytes, and the checks a read must pass.

A file is ``MAGIC``, the length of its manifest, the manifest (JSON: transfer id, layout, the
export's meta with the engine's integrity record, the layout fingerprint's digest and one
CRC-32 per buffer) and the extent's bytes. It is written to ``NAME.tmp`` and renamed into
place, so a reader never sees half of one. A read is trusted only when the file names the
entry asked for, carries the fingerprint and the layout the tier recorded when it spilled the
entry, is whole, and every buffer's checksum equals the one the tier computed then (kept in
memory, not taken from the file). Pure but for ``write_atomic`` and ``read``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from dsv4_kvtransfer.buffers import Layout
from dsv4_kvtransfer.integrity import (
    CHECKSUM_MISMATCH,
    FINGERPRINT_MISMATCH,
    IntegrityError,
    IntegrityRecord,
    buffer_checksums,
)

MAGIC = b"DSV4KVD1"
HEAD = struct.Struct("<8sI")  # magic, manifest length
SUFFIX = ".kv"
TMP_SUFFIX = ".kv.tmp"
MAX_MANIFEST = 16 << 20
READ_ERROR = "read_error"
_TID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def file_name(transfer_id: str, generation: int) -> str | None:
    """The file of the ``generation``-th spill of an entry (each spill its own name: a late
    delete of an older copy never hits a newer one); None for an id that is no safe name
    (host-tier ids are hex: ``pd_protocol.prefix_transfer_id``)."""
    return f"{transfer_id}.{generation}{SUFFIX}" if _TID.match(transfer_id) else None


def is_ours(name: str) -> bool:
    """A file the tier writes (what emptying the directory at start removes, nothing else)."""
    return name.endswith(SUFFIX) or name.endswith(TMP_SUFFIX)


def fingerprint_of(meta: dict[str, Any]) -> str | None:
    """The digest of the writer's layout fingerprint in an export's meta (None: it has none)."""
    try:
        record = IntegrityRecord.from_meta(meta)
    except IntegrityError:
        return None
    fp = record.fingerprint if record is not None else None
    return fp.digest if fp is not None else None


@dataclass(frozen=True, slots=True)
class Stamp:
    """What the tier remembers of an entry to check its file when it reads it back."""

    layout: Layout
    fingerprint: str | None
    checksums: dict[str, str]


def stamp(layout: Layout, meta: dict[str, Any], data: bytes | memoryview) -> Stamp:
    return Stamp(layout, fingerprint_of(meta), buffer_checksums(layout, memoryview(data)))


def encode_head(transfer_id: str, meta: dict[str, Any], st: Stamp) -> bytes:
    manifest = json.dumps(
        {
            "transfer_id": transfer_id,
            "layout": st.layout.to_dict(),
            "meta": meta,
            "fingerprint": st.fingerprint,
            "checksums": st.checksums,
        },
        separators=(",", ":"),
    ).encode()
    return HEAD.pack(MAGIC, len(manifest)) + manifest


def file_bytes(transfer_id: str, layout: Layout, meta: dict[str, Any], st: Stamp) -> int:
    """Bytes of the entry's file, what counts against the tier's cap."""
    return len(encode_head(transfer_id, meta, st)) + layout.total_bytes


def decode(raw: bytes, transfer_id: str, st: Stamp) -> tuple[dict[str, Any], memoryview]:
    """The meta and the extent's bytes of a file read back; ``IntegrityError`` (reason
    ``read_error``, ``fingerprint_mismatch`` or ``checksum_mismatch``) if it must not be used."""
    if len(raw) < HEAD.size:
        raise IntegrityError(READ_ERROR, f"disk entry {transfer_id}: truncated header")
    magic, n = HEAD.unpack_from(raw)
    if magic != MAGIC or n > MAX_MANIFEST or HEAD.size + n > len(raw):
        raise IntegrityError(READ_ERROR, f"disk entry {transfer_id}: not a disk-tier file")
    try:
        manifest = json.loads(raw[HEAD.size : HEAD.size + n])
        layout = Layout.from_dict(manifest["layout"])
        meta = manifest["meta"]
        named, fingerprint = manifest["transfer_id"], manifest["fingerprint"]
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(READ_ERROR, f"disk entry {transfer_id}: bad manifest: {e}") from e
    if named != transfer_id or not isinstance(meta, dict):
        raise IntegrityError(READ_ERROR, f"disk entry {transfer_id}: the file is entry {named!r}'s")
    if fingerprint != st.fingerprint or layout.to_dict() != st.layout.to_dict():
        raise IntegrityError(
            FINGERPRINT_MISMATCH,
            f"disk entry {transfer_id}: layout fingerprint {fingerprint} is not the spilled "
            f"entry's {st.fingerprint}: a stale file, not used",
        )
    data = memoryview(raw)[HEAD.size + n :]
    if len(data) != layout.total_bytes:
        raise IntegrityError(
            READ_ERROR, f"disk entry {transfer_id}: {len(data)} of {layout.total_bytes} bytes"
        )
    got = buffer_checksums(layout, data)
    bad = [name for name, crc in st.checksums.items() if got.get(name) != crc]
    if bad or set(got) != set(st.checksums):
        raise IntegrityError(
            CHECKSUM_MISMATCH,
            f"disk entry {transfer_id}: buffer {(bad or ['?'])[0]} is not what was spilled: "
            "corrupted on disk, not used",
        )
    return meta, data


def write_atomic(path: str, head: bytes, data: bytes | memoryview) -> None:
    """``path`` holds ``head + data`` whole or not at all (temp file, then rename); on an error
    nothing is left behind and the ``OSError`` goes up."""
    tmp = path.removesuffix(SUFFIX) + TMP_SUFFIX
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
