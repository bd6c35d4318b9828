"""The runner's block table, kept between steps (vLLM's persistent ``BlockTable``): one row
per state slot, rewritten only when its request's block list changed.

The KV cache manager hands each request's block ids as one list object until its blocks change
(``KVCacheManager.block_ids``: a new list at each new block, never one changed in place), so a
row whose list is the one written last is current: a decode step writes nothing for it, and a
step's table is one gather of its rows instead of B padded Python lists. (A TP follower gets
each step unpickled, new lists every step: it compares them with the row's, C-speed.) A row holds zeros past
its request's blocks, so a step's table is exactly the padded one ``AttentionMetadata.build``
would make from the lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4_serving.attention.metadata import SeqChunk


class BlockTable:
    def __init__(self, num_rows: int, width: int = 16) -> None:
        self.table = torch.zeros((num_rows, max(1, width)), dtype=torch.long)
        self._ids: list[Sequence[int] | None] = [None] * num_rows
        self.rows_written = 0  # rows (re)written so far: unchanged rows cost nothing

    def gather(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """``[len(chunks), max blocks]``: each chunk's row (by its state slot), zero-padded."""
        slots: list[int] = []
        width = 1
        written = self._ids
        for c in chunks:
            ids = c.block_ids
            last = written[c.state_slot]
            if last is not ids:
                if last is not None and last == ids:
                    written[c.state_slot] = ids  # an equal copy (a TP follower's step)
                else:
                    self._write(c.state_slot, ids)
            slots.append(c.state_slot)
            if len(ids) > width:
                width = len(ids)
        return self.table[torch.tensor(slots, dtype=torch.long), :width]

    def _write(self, slot: int, ids: Sequence[int]) -> None:
        old = self._ids[slot]
        n, old_n = len(ids), len(old) if old is not None else 0
        if n > self.table.shape[1]:
            wider = torch.zeros(
                (self.table.shape[0], max(n, 2 * self.table.shape[1])), dtype=torch.long
            )
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
        row = self.table[slot]
        if n:
            row[:n] = torch.tensor(ids, dtype=torch.long)
        if old_n > n:
            row[n:old_n] = 0  # past the blocks: zeros, as the padded table has
        self._ids[slot] = ids
        self.rows_written += 1
