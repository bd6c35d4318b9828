"""Same-host pulls the engine's own client copies, with no round trip before the bytes move.

A sidecar serving a same-host shm pull spent more on its request than on a 4 MiB copy: the
request to it, its parsing, the answer back, each in another process woken in turn. Here the
client holds a **grant** (an extent of its sidecar's region, held for it while its fast control
connection lives) and, for params naming an export on this host (``remote_shm``), does what the
sidecar's in-place pull does (``puller._run_in_place``), in its own process: the manifest from
the export's trailer, the copy into the grant, the trailer read again (intact: the bytes were
the export's), and the engine has its KV. Its sidecar learns of it later, in one message
(``adopt``: the grant becomes the pull's import under a lease, RELEASE goes to the prefill
side, a new grant comes back): with the engine's release of that KV (then the import is freed
at once and the new grant takes its place), or before the next pull, a poll of that pull, or
a second after at the latest (``FLUSH_S``). Answers are read before anything else is asked on
that connection, so nothing about a pull ever overtakes its adoption.

Anything else (no grant that fits, the export not readable here, the trailer retired meanwhile,
a sidecar that does not pull over shm) returns None, and the client asks its sidecar as always.
A grant is freed by its sidecar when the connection goes, never while an adoption sent on it
is unread: the sidecar reads the connection to its end (``control.FastControlServer``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsv4_kvtransfer.buffers import Layout, LayoutCache
from dsv4_kvtransfer.control_requests import FAST_REPLY, FAST_REQUEST, MAX_GRANT_BYTES
from dsv4_kvtransfer.integrity import (
    Fingerprint,
    IntegrityError,
    IntegrityRecord,
    check_fingerprint,
)
from dsv4_kvtransfer.pd_protocol import ShmSource
from dsv4_kvtransfer.staging import HEADER_BYTES, StagingError, StagingRegion
from dsv4_kvtransfer.transports.parallel_copy import ParallelCopy

log = logging.getLogger("dsv4.kv.client")
# a grant is at least this large (a power of two above the pull that asked for it)
MIN_GRANT_BYTES = 1 << 20
# after a grant was refused (the region full), not asked again for this long
REFUSED_S = 1.0
# a region the params named that is not here (another host): not looked for again this long
ABSENT_S = 10.0
# a pull copied here is adopted at the latest this long after (if nothing else told the sidecar)
FLUSH_S = 1.0


class FastConnection:
    """One connection to a sidecar's fast control socket; requests answered in order."""

    def __init__(self, path: str, timeout: float) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect(path)
        except BaseException:
            s.close()
            raise
        self.sock = s
        self.rfile = s.makefile("rb")

    def send(self, method: str, target: str, data: bytes | None, trace: str | None) -> None:
        line = f"{method} {target} {trace}\n" if trace else f"{method} {target}\n"
        msg = line.encode() + (data or b"")
        self.sock.sendall(FAST_REQUEST.pack(len(msg)) + msg)

    def reply(self) -> tuple[int, bytes]:
        head = self.rfile.read(FAST_REPLY.size)
        if len(head) < FAST_REPLY.size:
            raise ConnectionResetError("the sidecar closed the fast control connection")
        status, n = FAST_REPLY.unpack(head)
        raw = self.rfile.read(n) if n else b""
        if len(raw) < n:
            raise ConnectionResetError("the sidecar closed the fast control connection")
        return status, raw

    def call(
        self, method: str, target: str, data: bytes | None, trace: str | None, timeout: float
    ) -> tuple[int, bytes]:
        self.sock.settimeout(timeout)
        self.send(method, target, data, trace)
        return self.reply()

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


@dataclass(frozen=True, slots=True)
class Grant:
    grant_id: str
    offset: int
    capacity: int
    tag: str
    """The region's tag when granted (a restarted sidecar's grants are gone)."""
    conn: int
    """The connection it is held by (``LocalPuller._gen``): gone with it."""


@dataclass(frozen=True, slots=True)
class Landed:
    """A pull copied here: its id (the grant's), where it is, what the prefill side attached."""

    pull_id: str
    offset: int
    raw_layout: bytes
    layout: Layout
    meta: dict[str, Any]
    lease_expires_at: float


def grant_size(n: int) -> int:
    return max(MIN_GRANT_BYTES, 1 << max(0, n - 1).bit_length())


class LocalPuller:
    """The client's side of grants and in-place pulls (thread-safe; copies run unlocked)."""

    def __init__(
        self,
        sock_path: str,
        shm_dir: str,
        timeout_s: float,
        dest: Callable[[str], StagingRegion],
        copy_threads: int = 0,
    ) -> None:
        self.sock_path = sock_path
        self.shm_dir = shm_dir
        self.timeout_s = timeout_s
        self._dest = dest  # our sidecar's region, checked against a grant's tag
        self._lock = threading.Lock()
        self._conn: FastConnection | None = None
        self._gen = 0  # the connection's number, bumped when it is dropped
        self._copying = 0  # pulls copying into a grant now
        self._closing: list[FastConnection] = []  # dropped, closed once no copy runs
        self._owed: collections.deque[tuple[str, str]] = collections.deque()
        self._grants: list[Grant] = []
        self._unconfirmed: set[str] = set()  # adoptions sent, their answers not read yet
        # copied here, the sidecar not told yet: pull id -> (monotonic, the adoption's fields)
        self._pending: dict[str, tuple[float, list[Any], bytes, str | None]] = {}
        self._flusher: threading.Thread | None = None
        self._closed = threading.Event()
        self._want = 0  # the grant to ask for after the pull that found none
        self._ask_after = 0.0  # monotonic; inf: this sidecar grants nothing
        self._lease_s = 30.0
        self._sources: dict[str, StagingRegion] = {}
        self._absent: dict[tuple[str, str], float] = {}
        self._layouts = LayoutCache()
        # as the sidecar copies: one thread, or spread where that measured faster (from 2 MiB)
        self._copy = ParallelCopy(copy_threads)
        self.copies = 0
        """Pulls this client copied itself."""

    # ---- one pull ----------------------------------------------------------------------------

    def pull(
        self,
        tid: str,
        n: int,
        host: str,
        port: int,
        src: ShmSource,
        trace: str | None,
        expect: Fingerprint | None = None,
    ) -> Landed | None:
        """Copy the export in place into a grant; None: not done (nothing held), ask the
        sidecar. Integrity (``expect``: this engine's fingerprint) as the sidecar checks it; a
        mismatch is left to the sidecar too, which fails the pull with its reason and counts
        it."""
        t0 = time.perf_counter()
        if not 0 < n <= MAX_GRANT_BYTES or self._ask_after == math.inf:
            return None
        region = self._source(src)
        if region is None or src.offset < HEADER_BYTES or src.offset + n > region.size:
            return None
        trailer = region.trailer(src.offset + n, tid)
        if trailer is None:
            return None
        raw_layout, _, raw_meta = trailer.manifest.partition(b"\n")
        try:
            layout = self._layouts.get(raw_layout)
            meta = json.loads(raw_meta)
        except ValueError:  # (LayoutError is one)
            return None
        if layout.total_bytes != n or not isinstance(meta, dict):
            return None
        try:
            record = IntegrityRecord.from_meta(meta)
            check_fingerprint(record, expect)
        except IntegrityError:
            return None
        grant = self._take(n)
        if grant is None:
            return None
        landed = adopted = broken = False
        data_s = 0.0
        try:  # (the grant's connection stays open meanwhile, even if dropped: ``_reset``)
            dest = self._dest(grant.tag)  # our sidecar's region, re-mapped if it restarted
            t_copy = time.perf_counter()
            with dest.view(grant.offset, n) as d, region.view(src.offset, n) as s:
                self._copy.copy(d, s)
                data_s = time.perf_counter() - t_copy
                landed = trailer.intact() and _verified(record, layout, d)
        except Exception as e:  # (a restarted sidecar: the grant's region is gone)
            log.warning("in-place pull of %s: %s; the sidecar makes it", tid, e)
            broken = True
        finally:
            with self._lock:
                if grant.conn != self._gen:
                    pass  # its connection was dropped meanwhile, and the grant with it
                elif broken:
                    self._reset()
                elif landed:  # the sidecar is told later (``_flush``)
                    head = [tid, host, port, n, time.perf_counter() - t0, data_s, grant.capacity]
                    self._pending[grant.grant_id] = (
                        time.monotonic(),
                        head,
                        trailer.manifest,
                        trace,
                    )
                    adopted = True
                else:
                    self._grants.append(grant)  # for the next pull
                self._copying -= 1
                if not self._copying and self._closing:
                    for c in self._closing:
                        c.close()
                    self._closing.clear()
        if not adopted:
            return None  # the sidecar makes the pull
        if self._flusher is None:
            self._start_flusher()
        self.copies += 1
        expires = time.time() + self._lease_s  # (the sidecar's lease starts later)
        return Landed(grant.grant_id, grant.offset, raw_layout, layout, meta, expires)

    def after_fallback(self) -> None:
        """The sidecar made a pull no grant fitted: ask for one that fits the next such pull
        (its answer is read with the next request on this connection)."""
        with self._lock:
            want, self._want = self._want, 0
            if not want or time.monotonic() < self._ask_after:
                return
            if any(kind == "grant" for kind, _ in self._owed):
                return
            if self._send("POST", "/v1/grants", json.dumps({"bytes": want}).encode(), None):
                self._owed.append(("grant", ""))

    def confirm(self, pull_id: str) -> None:
        """Before a call about ``pull_id``: its adoption has been sent and answered."""
        with self._lock:  # (a flush moves it from pending to unconfirmed under the lock)
            if pull_id in self._pending or pull_id in self._unconfirmed:
                self._flush()
                self._settle()

    def release(self, pull_id: str) -> bool:
        """The engine is done with a pull copied here and not yet adopted: adopted and freed
        in one message (its successor grant takes its place), answered later (the engine's
        loop does not wait for it); -> whether it was one."""
        with self._lock:
            if pull_id not in self._pending:
                self._settle()  # (an adoption sent, unanswered: answered first)
                return False
            self._flush(release=pull_id)
            return True

    def settle(self) -> None:
        """Until every adoption sent has been answered (the sidecar is done with them)."""
        with self._lock:
            self._settle()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._flush()  # adopted (their leases run) before the connection and its grants go
            self._reset()
            for r in self._sources.values():
                r.close()
            self._sources.clear()
        self._copy.close()

    # ---- grants (under the lock) -------------------------------------------------------------

    def _take(self, n: int) -> Grant | None:
        """The smallest grant held that fits ``n`` bytes. None fitting: give back those held
        (the sidecar's own pull may need their space) and ask for one after it."""
        with self._lock:
            if self._pending:
                self._flush()
            if self._owed and not self._settle():
                return None
            best = None
            for g in self._grants:
                if g.capacity >= n and (best is None or g.capacity < best.capacity):
                    best = g
            if best is not None:
                self._grants.remove(best)
                self._copying += 1
                return best
            held, self._grants = self._grants, []
            for g in held:
                if self._send("DELETE", f"/v1/grants/{g.grant_id}", None, None):
                    self._owed.append(("return", g.grant_id))
            self._settle()
            self._want = max(self._want, grant_size(n))
            return None

    def _send(self, method: str, target: str, body: bytes | None, trace: str | None) -> bool:
        try:
            if self._conn is None:
                self._conn = FastConnection(self.sock_path, self.timeout_s)
            self._conn.send(method, target, body, trace)
            return True
        except OSError as e:
            log.debug("fast control (grants): %s", e)
            self._reset()
            self._ask_after = time.monotonic() + ABSENT_S
            return False

    def _flush(self, release: str | None = None) -> None:
        """Send the adoptions pending (the one of ``release`` freed at once too)."""
        while self._pending:
            gid, (_, head, manifest, trace) = self._pending.popitem()
            body = json.dumps([*head, gid == release]).encode() + b"\n" + manifest
            if not self._send("POST", f"/v1/grants/{gid}/adopt", body, trace):
                return  # (the connection is gone, and the grants with it)
            self._owed.append(("adopt", gid))
            self._unconfirmed.add(gid)

    def _start_flusher(self) -> None:
        with self._lock:
            if self._flusher is not None:
                return
            self._flusher = threading.Thread(target=self._flush_loop, name="kv-adopt", daemon=True)
        self._flusher.start()

    def _flush_loop(self) -> None:
        """Adoptions nothing else sent within ``FLUSH_S`` (their answers are read later)."""
        while not self._closed.wait(FLUSH_S / 2):
            with self._lock:
                due = time.monotonic() - FLUSH_S
                if any(t < due for t, *_ in self._pending.values()):
                    self._flush()

    def _settle(self) -> bool:
        """Read every answer owed; -> False if the connection broke (then nothing is held)."""
        while self._owed:
            kind, gid = self._owed[0]
            assert self._conn is not None
            try:
                status, raw = self._conn.reply()
                body = json.loads(raw) if raw else {}
            except (OSError, ValueError) as e:
                log.warning("fast control (grants): %s", e)
                self._reset()
                return False
            self._owed.popleft()
            if kind == "adopt":
                self._unconfirmed.discard(gid)
                if status != 200:  # the extent stays held by the connection: never reused
                    log.error("the KV sidecar did not adopt pull %s: %s", gid, body)
                    continue
            if status == 200 and kind in ("grant", "adopt"):
                g = body.get("grant", body) if kind == "adopt" else body
                if "grant_id" in g:
                    gid, offset, cap = str(g["grant_id"]), int(g["offset"]), int(g["capacity"])
                    self._grants.append(Grant(gid, offset, cap, str(g["shm_tag"]), self._gen))
                    self._lease_s = float(g.get("lease_seconds", self._lease_s))
                elif "grant_error" in body:
                    self._refused(str(body["grant_error"]))
            elif status != 200 and kind == "grant":
                self._refused(str(body.get("error", {}).get("code")))
        return True

    def _refused(self, code: str) -> None:
        self._ask_after = math.inf if code == "unsupported" else time.monotonic() + REFUSED_S

    def _reset(self) -> None:
        """Drop the connection: the sidecar frees its grants once it closes (after serving any
        adoption sent on it), so it closes only when no copy into one of them runs; adoptions
        not sent yet go first, so no extent the engine may be reading is freed meanwhile."""
        if self._conn is not None and self._pending:
            conn, pending, self._pending = self._conn, self._pending, {}
            for gid, (_, head, manifest, trace) in pending.items():
                with contextlib.suppress(OSError):
                    body = json.dumps([*head, False]).encode() + b"\n" + manifest
                    conn.send("POST", f"/v1/grants/{gid}/adopt", body, trace)
        if self._conn is not None:
            if self._copying:
                self._closing.append(self._conn)
            else:
                self._conn.close()
            self._conn = None
        self._gen += 1
        self._owed.clear()
        self._grants.clear()
        self._unconfirmed.clear()

    # ---- the exports' regions ----------------------------------------------------------------

    def _source(self, src: ShmSource) -> StagingRegion | None:
        region = self._sources.get(src.name)
        if region is not None and region.tag_hex == src.tag:
            return region
        key = (src.name, src.tag)
        if self._absent.get(key, 0.0) > time.monotonic():
            return None
        try:
            new = StagingRegion.attach(src.name, self.shm_dir, writable=False)
        except StagingError:
            new = None
        if new is None or new.tag_hex != src.tag:
            if new is not None:
                new.close()
            self._absent[key] = time.monotonic() + ABSENT_S
            return None
        drop: StagingRegion | None
        with self._lock:
            old = self._sources.get(src.name)
            if old is not None and old.tag_hex == new.tag_hex:
                # another pull attached the same region meanwhile: it may be reading it now,
                # so keep that mapping and drop this one (closing it would fail its reads)
                keep, drop = old, new
            else:
                self._sources[src.name] = keep = new
                drop = old  # None, or the region of a sidecar that restarted: no export's now
        if drop is not None:
            drop.close()
        return keep


def _verified(record: IntegrityRecord | None, layout: Layout, copied: memoryview) -> bool:
    if record is None:
        return True
    try:
        record.verify(layout, copied)
    except IntegrityError as e:
        log.warning("in-place pull: %s; the sidecar makes it", e)
        return False
    return True
