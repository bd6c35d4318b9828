"""TCP: DATA frames straight from the remote region into ours, in parallel streams.

The extent is split into up to ``streams`` contiguous ranges of at least ``min_stream_bytes``;
range 0 goes over the control connection, the others over extra authenticated connections, each
in its own thread (``sendall``/``recv_into`` release the GIL, so streams overlap). Small
transfers use one stream: a second handshake costs more than it saves.
"""

from __future__ import annotations

import threading
import time

from dsv4_kvtransfer.buffers import align_up
from dsv4_kvtransfer.peer import PeerConnection
from dsv4_kvtransfer.transports.base import FetchJob, Transport


def split_ranges(
    total: int, streams: int, min_bytes: int, align: int = 4096
) -> list[tuple[int, int]]:
    """``[(offset, length)]`` covering ``[0, total)``: at most ``streams`` ranges, each at least
    ``min_bytes`` (except when ``total`` is smaller), boundaries on ``align``."""
    if total <= 0:
        return []
    n = max(1, min(streams, total // max(min_bytes, 1)))
    step = align_up(-(-total // n), align)
    out = []
    off = 0
    while off < total:
        length = min(step, total - off)
        out.append((off, length))
        off += length
    return out


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, streams: int = 4, min_stream_bytes: int = 32 << 20) -> None:
        if streams < 1:
            raise ValueError("streams must be >= 1")
        self.streams = streams
        self.min_stream_bytes = min_stream_bytes

    def pipelined_request(self, conn: PeerConnection, transfer_id: str, total_bytes: int) -> bytes:
        """The READ of range 0 (the control connection's share)."""
        ranges = split_ranges(total_bytes, self.streams, self.min_stream_bytes)
        return conn.read_request(transfer_id, *ranges[0]) if ranges else b""

    def fetch(self, job: FetchJob) -> None:
        ranges = split_ranges(len(job.dest), self.streams, self.min_stream_bytes)
        if len(ranges) <= 1:
            self._read(job.control, job, 0, len(job.dest), job.requested)
            return
        errors: list[BaseException] = []
        extra: list[PeerConnection] = []
        lock = threading.Lock()

        def worker(off: int, length: int) -> None:
            try:
                conn = job.connect()
                with lock:
                    extra.append(conn)
                conn.settimeout(max(job.deadline - time.monotonic(), 0.001))
                self._read(conn, job, off, length)
            except BaseException as e:
                with lock:
                    errors.append(e)
                    # unblock the other streams: one failed range fails the pull
                    for c in extra:
                        c.close()
                job.control.close()

        threads = [
            threading.Thread(target=worker, args=r, name=f"kv-stream-{i}", daemon=True)
            for i, r in enumerate(ranges[1:], start=1)
        ]
        for t in threads:
            t.start()
        try:
            self._read(job.control, job, *ranges[0], job.requested)
        except BaseException as e:
            with lock:
                errors.append(e)
                for c in extra:
                    c.close()
        for t in threads:
            t.join()
        for c in extra:
            c.close()
        if errors:
            raise errors[0]

    @staticmethod
    def _read(
        conn: PeerConnection, job: FetchJob, off: int, length: int, requested: bool = False
    ) -> None:
        conn.read_into(
            job.transfer_id,
            off,
            job.dest[off : off + length],
            job.progress,
            job.deadline,
            requested,
        )
