"""Follow our sidecar's host-tier evictions and moves (``GET /v1/host-tier/evictions``) on a
thread of its own, so the engine core can announce each in its next step's KV events: an entry
gone as a ``BlockRemoved`` of the medium it was announced in, one moved between the host and
the disk tier as a ``BlockRemoved`` of the old medium and a ``BlockStored`` of the new one (the
tiers evict and spill on their own; without this the gateway's index would keep offering pulls
of gone entries)."""

from __future__ import annotations

import logging
import queue
import threading

from dsv4_kvtransfer.client import SidecarClient, SidecarError

log = logging.getLogger(__name__)
INTERVAL_S = 1.0
_LATEST = 1 << 62  # a ``since`` past every eviction: the answer is just the next number


class HostEvictionWatcher:
    def __init__(self, client: SidecarClient, interval_s: float = INTERVAL_S) -> None:
        self.client, self.interval_s = client, interval_s
        self._since: int | None = None  # None: start from now (older ones are not ours)
        self._ids: queue.SimpleQueue[tuple[str, str | None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-host-evictions", daemon=True)
        self._thread.start()

    def take(self) -> list[tuple[str, str | None]]:
        """(transfer id, its medium now; None: gone) of each record since the last call."""
        out: list[tuple[str, str | None]] = []
        while True:
            try:
                out.append(self._ids.get_nowait())
            except queue.Empty:
                return out

    def poll(self) -> None:
        try:
            nxt, ids, lost = self.client.host_tier_moves(
                _LATEST if self._since is None else self._since
            )
        except (SidecarError, OSError, KeyError, ValueError) as e:
            log.debug("host-tier evictions: %s", e)
            return
        if lost:
            log.warning("host-tier evictions: some were lost; the gateway may try those pulls")
        if self._since is not None:
            for tid in ids:
                self._ids.put(tid)
        self._since = nxt

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
