"""The disk tier under the host tier: entries the host tier's LRU evicts spill to files here,
under a byte cap, and a pull that asks for one reads it back into the host tier.

- **Spill** (``spill``, called under the staging store's lock while the ledger evicts, so it
  does no I/O): the entry's bytes are copied, it joins the index at once (a pull finds it from
  then on: from memory until its file is written) and a writer thread writes its file
  atomically (``disk_files.write_atomic``). Past the cap the least recently spilled entries
  are dropped first. An entry larger than the cap, or one that would push the bytes still
  waiting for the writer past ``max_pending``, is not taken (the host tier evicts it as
  before).
- **Read back** (``take``): the entry leaves the index and its file is read and checked
  (``disk_files.decode``: the fingerprint and the layout recorded at spill, every buffer's
  CRC-32); the caller puts it back into the host tier. A file that fails a check is dropped
  and counted by reason, never used.
- **Errors are drops.** A write or read error (disk full, the directory gone) drops the entry
  and counts it; nothing here raises at run time. Every entry that leaves the tier for good
  goes to ``on_gone``, which announces it as evicted.
- **Emptied at start.** The engine's KV events start over when its sidecar does (batch 0
  clears the gateway's index) and it announces only what it offered since, so a file left by
  an earlier process could never be pulled: it would only take room. ``open`` therefore
  removes the tier's files (``*.kv``, ``*.kv.tmp``; nothing else in the directory).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dsv4_kvtransfer import disk_files
from dsv4_kvtransfer.buffers import Layout
from dsv4_kvtransfer.integrity import IntegrityError
from dsv4_kvtransfer.metrics import SidecarMetrics

MAX_PENDING_BYTES = 256 << 20
log = logging.getLogger("dsv4.kv.disk_tier")


class DiskTierError(Exception):
    """The tier cannot run in its directory (at start only)."""


@dataclass
class DiskIndex:
    """LRU accounting of the tier's entries (pure): ids -> file bytes, oldest first."""

    cap: int
    entries: OrderedDict[str, int] = field(default_factory=OrderedDict)
    used: int = 0

    def admit(self, transfer_id: str, nbytes: int) -> list[str] | None:
        """Make room for an entry of ``nbytes`` and add it; -> the ids dropped for the room
        (oldest first; an older copy of the same id among them), None if it can never fit."""
        if nbytes > self.cap:
            return None
        victims = [transfer_id] if self.remove(transfer_id) is not None else []
        while self.used + nbytes > self.cap:
            old, size = self.entries.popitem(last=False)
            self.used -= size
            victims.append(old)
        self.entries[transfer_id] = nbytes
        self.used += nbytes
        return victims

    def remove(self, transfer_id: str) -> int | None:
        size = self.entries.pop(transfer_id, None)
        if size is not None:
            self.used -= size
        return size


@dataclass
class _Entry:
    generation: int
    layout: Layout
    meta: dict[str, Any]
    nbytes: int
    data: bytes | None
    """The bytes until the writer wrote them (then None and ``stamp`` is set)."""
    stamp: disk_files.Stamp | None = None


class DiskTier:
    def __init__(
        self,
        directory: str,
        cap: int,
        metrics: SidecarMetrics,
        on_gone: Callable[[Iterable[str]], None] = lambda ids: None,
        max_pending: int = MAX_PENDING_BYTES,
    ) -> None:
        self.directory, self.metrics, self.on_gone = directory, metrics, on_gone
        self.index = DiskIndex(cap)
        self.max_pending = max_pending
        self._entries: dict[str, _Entry] = {}
        self._pending = 0  # bytes waiting for the writer
        self._generation = 0
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[str, str, int] | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Create or empty the directory, prove it writable, start the writer;
        ``DiskTierError`` naming the directory if it cannot be used."""
        d = self.directory
        try:
            os.makedirs(d, exist_ok=True)
            for name in os.listdir(d):
                if disk_files.is_ours(name):
                    os.unlink(os.path.join(d, name))
            probe = os.path.join(d, f".probe-{os.getpid()}{disk_files.TMP_SUFFIX}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
        except OSError as e:
            raise DiskTierError(f"--kv-disk-dir {d}: not a writable directory ({e})") from None
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()
        self._gauges()

    def close(self) -> None:
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join(timeout=5)
            self._writer = None

    def flush(self) -> None:
        """Wait until every queued write and delete is done (tests, benchmarks)."""
        self._jobs.join()

    # ---- the store's side ------------------------------------------------------------------

    def spill(self, transfer_id: str, layout: Layout, meta: dict[str, Any], data: bytes) -> bool:
        """Take an entry the host tier evicts; -> whether it did (no I/O: the writer writes)."""
        placeholder = disk_files.Stamp(
            layout, disk_files.fingerprint_of(meta), {b.spec.name: "0" * 8 for b in layout.buffers}
        )
        with self._lock:
            if disk_files.file_name(transfer_id, 0) is None or (
                self._pending + len(data) > self.max_pending
            ):
                victims = None
            else:
                nbytes = disk_files.file_bytes(transfer_id, layout, meta, placeholder)
                victims = self.index.admit(transfer_id, nbytes)
            if victims is None:
                self.metrics.disk_tier_drops.labels("not_taken").inc()
                return False
            gone = [v for v in victims if v != transfer_id]
            for v in victims:
                self._forget(v)
            self._generation += 1
            self._entries[transfer_id] = _Entry(self._generation, layout, meta, nbytes, data)
            self._pending += len(data)
            self._jobs.put(("write", transfer_id, self._generation))
        self.metrics.disk_tier_spills.inc()
        if gone:
            self.metrics.disk_tier_drops.labels("evicted").inc(len(gone))
            self.on_gone(gone)
        self._gauges()
        return True

    def take(self, transfer_id: str) -> tuple[Layout, dict[str, Any], bytes | memoryview] | None:
        """The entry's layout, meta and bytes, checked; it leaves the tier. None: the tier has
        no such entry, or its file failed a check (dropped, counted, announced gone)."""
        with self._lock:
            e = self._entries.pop(transfer_id, None)
            if e is None:
                return None
            self.index.remove(transfer_id)
            if e.data is not None:
                self._pending -= len(e.data)  # the writer finds it gone and deletes its file
        self._gauges()
        if e.data is not None:
            self.metrics.disk_tier_hits.inc()
            return e.layout, e.meta, e.data
        assert e.stamp is not None
        path = self._path(transfer_id, e.generation)
        try:
            raw = disk_files.read(path)
            meta, data = disk_files.decode(raw, transfer_id, e.stamp)
        except (OSError, IntegrityError) as err:
            reason = getattr(err, "reason", disk_files.READ_ERROR)
            log.warning("disk tier: %s dropped (%s): %s", transfer_id, reason, err)
            self._drop_counted(transfer_id, reason)
            return None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.metrics.disk_tier_hits.inc()
        return e.layout, meta, data

    def __contains__(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._entries

    def usage(self) -> tuple[int, int]:
        """(bytes, entries) of the tier."""
        with self._lock:
            return self.index.used, len(self.index.entries)

    # ---- internals -------------------------------------------------------------------------

    def _path(self, transfer_id: str, generation: int) -> str:
        name = disk_files.file_name(transfer_id, generation)
        assert name is not None
        return os.path.join(self.directory, name)

    def _forget(self, transfer_id: str) -> None:
        """(Under the lock.) The entry is out of the index: its file goes too, by the writer."""
        e = self._entries.pop(transfer_id, None)
        if e is None:
            return
        if e.data is not None:
            self._pending -= len(e.data)
        self._jobs.put(("delete", transfer_id, e.generation))

    def _drop_counted(self, transfer_id: str, reason: str) -> None:
        self.metrics.disk_tier_drops.labels(reason).inc()
        self.on_gone([transfer_id])
        self._gauges()

    def _gauges(self) -> None:
        used, n = self.usage()
        self.metrics.disk_tier_bytes.set(used)
        self.metrics.disk_tier_entries.set(n)

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                kind, tid, gen = job
                if kind == "delete":
                    with contextlib.suppress(OSError):
                        os.unlink(self._path(tid, gen))
                else:
                    self._write(tid, gen)
            except Exception:  # never let the writer die: later entries still need it
                log.exception("disk tier: %s", job)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _write(self, transfer_id: str, generation: int) -> None:
        with self._lock:
            e = self._entries.get(transfer_id)
            if e is None or e.generation != generation or e.data is None:
                return
            data = e.data
        path = self._path(transfer_id, generation)
        try:
            st = disk_files.stamp(e.layout, e.meta, data)
            disk_files.write_atomic(path, disk_files.encode_head(transfer_id, e.meta, st), data)
        except OSError as err:
            log.warning("disk tier: writing %s failed, dropped: %s", transfer_id, err)
            with self._lock:
                if self._entries.get(transfer_id) is not e:
                    return  # taken or replaced meanwhile: not this write's to count
                self._entries.pop(transfer_id)
                self.index.remove(transfer_id)
                self._pending -= len(data)
            self._drop_counted(transfer_id, "write_error")
            return
        with self._lock:
            if self._entries.get(transfer_id) is e:
                e.stamp, e.data = st, None
                self._pending -= len(data)
                return
        with contextlib.suppress(OSError):  # taken or replaced while it was written
            os.unlink(path)
