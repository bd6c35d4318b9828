"""Paged storage of per-token or per-compressed-entry rows.

A storage tensor is ``[num_blocks, rows_per_block, ...]``; block ``b`` of a sequence's block
table holds its rows ``b * rows_per_block ...``. For per-token storage ``rows_per_block`` is the
engine's block size; for V4's compressed entries of ratio ``r`` it is ``block_size // r``, so one
block table addresses both (block ``b`` covers tokens ``[b * block_size, (b + 1) * block_size)``).
"""

from __future__ import annotations

import torch


def gather_entries(storage: torch.Tensor, block_row: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``0 .. n-1`` of one sequence, ``[n, ...]``."""
    per = storage.shape[1]
    if n == 0:
        return storage.new_zeros((0, *storage.shape[2:]))
    nb = -(-n // per)
    return storage[block_row[:nb]].flatten(0, 1)[:n]


def scatter_entries(
    storage: torch.Tensor, block_row: torch.Tensor, index: torch.Tensor, values: torch.Tensor
) -> None:
    """Write ``values[i]`` to row ``index[i]`` of one sequence."""
    if index.numel() == 0:
        return
    per = storage.shape[1]
    storage[block_row[index // per], index % per] = values.to(storage.dtype)
