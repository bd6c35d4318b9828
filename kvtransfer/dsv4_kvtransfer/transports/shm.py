"""Same-host shared memory: map the remote sidecar's staging region and copy from it.

The remote pins the export and answers with its region's name and tag; we open the region by
name in our own shared-memory directory (same host, same /dev/shm) and check the tag, so a
name that happens to exist elsewhere is never read. The mapping is kept (pre-faulted once, not
per pull), the ``SHM_MAP`` request goes out with the manifest's (one round trip per pull), and
each chunk is copied by several threads (``parallel_copy``). No sockets on the data path.

Faster still (``direct_source``): the params name the export's place (``remote_shm``) and its
trailer there holds the manifest, so the pull copies at once and asks nobody; the trailer found
intact after the copy proves the bytes were the export's (``staging.Trailer``). Otherwise (the
region is not here, the export is gone or was retired meanwhile) the pull asks as above.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dsv4_kvtransfer.frames import FrameType, encode
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams, shm_source
from dsv4_kvtransfer.peer import PeerConnection
from dsv4_kvtransfer.staging import HEADER_BYTES, TRAILER, StagingError, StagingRegion, Trailer
from dsv4_kvtransfer.transports.base import DirectSource, FetchJob, TransferFailed, Transport
from dsv4_kvtransfer.transports.parallel_copy import ParallelCopy

CHUNK = 64 << 20
# a region the params named that is not here (another host): not looked for again this long
ABSENT_RETRY_S = 10.0


class _InPlace(DirectSource):
    def __init__(self, t: ShmTransport, region: StagingRegion, p: RemotePrefillParams, offset: int):
        self._t, self._region, self._offset = t, region, offset
        self._tid, self._n = p.remote_transfer_id, p.remote_total_bytes

    def trailer(self) -> Trailer | None:
        return self._region.trailer(self._offset + self._n, self._tid)

    def copy_into(self, dest: memoryview, deadline: float) -> None:
        with self._region.view(self._offset, self._n) as src:
            self._t.copy(dest, src, deadline)


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, shm_dir: str = "/dev/shm", copy_threads: int = 0) -> None:
        self.shm_dir = shm_dir
        self._regions: dict[str, StagingRegion] = {}
        self._lock = threading.Lock()
        self._copy = ParallelCopy(copy_threads)
        self._absent: dict[tuple[str, str], float] = {}

    def _region(self, name: str, tag: str) -> StagingRegion:
        with self._lock:
            region = self._regions.get(name)
            if region is not None and region.tag_hex != tag:
                # the remote sidecar restarted under the same name: a new segment
                region.close()
                region = None
            if region is None:
                try:
                    region = StagingRegion.attach(name, self.shm_dir, writable=False)
                except StagingError as e:
                    raise TransferFailed(
                        "shm_unreachable",
                        f"shm transport needs both sidecars on one host sharing {self.shm_dir}: {e}",
                    ) from None
                self._regions[name] = region
            if region.tag_hex != tag:
                raise TransferFailed(
                    "shm_unreachable",
                    f"{self.shm_dir}/{name} is not the remote sidecar's region (different host?)",
                )
            return region

    def direct_source(self, params: RemotePrefillParams) -> DirectSource | None:
        src = shm_source(params.extra)
        if src is None or not params.remote_total_bytes:
            return None
        key = (src.name, src.tag)
        if self._absent.get(key, 0.0) > time.monotonic():
            return None
        try:
            region = self._region(src.name, src.tag)
        except TransferFailed:
            self._absent[key] = time.monotonic() + ABSENT_RETRY_S
            return None
        end = src.offset + params.remote_total_bytes + TRAILER.size
        if src.offset < HEADER_BYTES or end > region.size:
            return None
        return _InPlace(self, region, params, src.offset)

    def copy(
        self,
        dest: memoryview,
        src: memoryview,
        deadline: float,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``dest[:] = src`` in chunks, each spread over the copy threads."""
        for pos in range(0, len(src), CHUNK):
            if time.monotonic() > deadline:
                raise TimeoutError("the pull ran past its deadline")
            end = min(pos + CHUNK, len(src))
            self._copy.copy(dest[pos:end], src[pos:end])
            if progress is not None:
                progress(end - pos)

    def pipelined_request(self, conn: PeerConnection, transfer_id: str, total_bytes: int) -> bytes:
        return encode(FrameType.SHM_MAP, {"transfer_id": transfer_id})

    def fetch(self, job: FetchJob) -> None:
        info = (
            job.control.reply(FrameType.SHM_INFO)
            if job.requested
            else job.control.request(
                FrameType.SHM_MAP, {"transfer_id": job.transfer_id}, FrameType.SHM_INFO
            )
        )
        name, tag, offset, length = (
            info.get("shm_name"),
            info.get("tag"),
            info.get("offset"),
            info.get("length"),
        )
        if not (
            isinstance(name, str)
            and isinstance(tag, str)
            and isinstance(offset, int)
            and isinstance(length, int)
            and offset >= HEADER_BYTES
            and length == len(job.dest)
        ):
            raise TransferFailed("protocol", f"bad SHM_INFO from the remote sidecar: {info}")
        region = self._region(name, tag)
        try:
            src = region.view(offset, length)
        except StagingError as e:
            raise TransferFailed("protocol", f"remote extent out of range: {e}") from None
        with src:
            self.copy(job.dest, src, job.deadline, job.progress)

    def close(self) -> None:
        self._copy.close()
        with self._lock:
            for r in self._regions.values():
                r.close()
            self._regions.clear()
