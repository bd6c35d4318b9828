"""The one prefix-block hash: chained over full blocks of token ids.

``hash(block k) = sha256(hash(block k-1) || token ids of block k || extra)``: a block's hash
names the whole prefix up to its end, so equal hashes mean equal prefixes. sha256 (not
Python's salted ``hash``) so that every process, the engine's and the gateway's, computes the
same value. The gateway imports this module to route by prefix; it never loads torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

# the parent of the first block: fixed, so hashes are comparable across processes and restarts
ROOT_HASH: BlockHash = hashlib.sha256(b"dsv4-prefix-v1").digest()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b""
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block). ``extra``
    separates caches that must not share blocks (e.g. a LoRA adapter or a cache salt)."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash | None = None,
    extra: bytes = b"",
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        out.append(parent)
    return out
