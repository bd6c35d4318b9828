"""The host tier's evictions, numbered, for the engine beside the sidecar to announce.

The tier evicts entries on its own (LRU, by its cap or for room). The gateway's index learned
each entry from the engine's KV events (a medium ``"CPU"`` ``BlockStored``), so the engine
must also say when one is gone: it asks ``GET /v1/host-tier/evictions?since=N`` now and then
and publishes a ``BlockRemoved`` for each. Every eviction gets the next number; the log keeps
the last ``capacity``, and an answer says ``lost`` when the asker's ``since`` is older than
that (it then learns no more of those: the index overestimates them until a pull fails).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Evictions:
    next: int
    """The number of the next eviction: the ``since`` of the following ask."""
    transfer_ids: list[str]
    lost: bool
    """Evictions between ``since`` and the oldest one kept are gone from the log."""

    def to_dict(self) -> dict[str, object]:
        return {"next": self.next, "transfer_ids": self.transfer_ids, "lost": self.lost}


class EvictionLog:
    def __init__(self, capacity: int = 4096) -> None:
        self._ids: deque[str] = deque(maxlen=capacity)
        self._next = 0  # the number the next eviction gets
        self._lock = threading.Lock()

    def add(self, transfer_ids: Iterable[str]) -> None:
        with self._lock:
            for tid in transfer_ids:
                self._ids.append(tid)
                self._next += 1

    def since(self, n: int) -> Evictions:
        """The evictions numbered ``n`` and after (a ``since`` past the end: none)."""
        with self._lock:
            first = self._next - len(self._ids)  # the number of the oldest kept
            start = max(n, first)
            ids = list(self._ids)[start - first :] if start < self._next else []
            return Evictions(self._next, ids, n < first)
