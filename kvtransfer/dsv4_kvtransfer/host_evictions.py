"""The host tier's evictions and moves, numbered, for the engine beside the sidecar to announce.

The tier evicts entries on its own (LRU, by its cap or for room), and with a disk tier moves
them: an evicted entry spilled to disk, a disk entry read back for a pull. The gateway's index
learned each entry from the engine's KV events (a medium ``"CPU"`` ``BlockStored``), so the
engine must also say when one is gone or moved: it asks ``GET /v1/host-tier/evictions?since=N``
now and then and publishes a ``BlockRemoved`` for each one gone, and a ``BlockRemoved`` of the
old medium plus a ``BlockStored`` of the new one (``"DISK"`` or ``"CPU"``) for each move. Every
record gets the next number; the log keeps the last ``capacity``, and an answer says ``lost``
when the asker's ``since`` is older than that (it then learns no more of those: the index
overestimates them until a pull fails). ``transfer_ids`` lists the entries gone, ``moves``
every record in order as ``[transfer id, medium]`` (medium null: gone).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

Move = tuple[str, str | None]
"""A transfer id and the medium its entry is in now (None: gone from the sidecar)."""


@dataclass(frozen=True, slots=True)
class Evictions:
    next: int
    """The number of the next record: the ``since`` of the following ask."""
    transfer_ids: list[str]
    """The entries gone (the moves to None)."""
    lost: bool
    """Records between ``since`` and the oldest one kept are gone from the log."""
    moves: list[Move] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {
            "next": self.next,
            "transfer_ids": self.transfer_ids,
            "lost": self.lost,
            "moves": [list(m) for m in self.moves],
        }


class EvictionLog:
    def __init__(self, capacity: int = 4096) -> None:
        self._moves: deque[Move] = deque(maxlen=capacity)
        self._next = 0  # the number the next record gets
        self._lock = threading.Lock()

    def add(self, transfer_ids: Iterable[str]) -> None:
        """Entries gone from the sidecar."""
        self.add_moves(transfer_ids, None)

    def add_moves(self, transfer_ids: Iterable[str], medium: str | None) -> None:
        with self._lock:
            for tid in transfer_ids:
                self._moves.append((tid, medium))
                self._next += 1

    def since(self, n: int) -> Evictions:
        """The records numbered ``n`` and after (a ``since`` past the end: none)."""
        with self._lock:
            first = self._next - len(self._moves)  # the number of the oldest kept
            start = max(n, first)
            moves = list(self._moves)[start - first :] if start < self._next else []
            gone = [tid for tid, medium in moves if medium is None]
            return Evictions(self._next, gone, n < first, moves)
