"""The pool of paged KV blocks: free list, reference counts, and the prefix cache's
hash -> block map. Pure Python.

The free list is ordered for eviction: a block freed by a finished request goes to the tail
and keeps its hash, so it can still be hit until it reaches the head and is reused. Requests
free their blocks last-first, so a prompt's tail blocks are evicted before its head (the head
is the part other prompts are most likely to share).

With events on, evicting a cached block records a ``BlockRemoved`` and a reset an
``AllBlocksCleared`` (``dsv4_common.kv_events``); the manager records what is stored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from dsv4_common.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from dsv4_serving.engine.core.prefix_hash import BlockHash


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, enable_events: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # ids in eviction order (head first); holds exactly the blocks with ref_cnt == 0
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        # KV events not yet taken (``take_events``); None: events off, nothing recorded
        self.events: list[KVCacheEvent] | None = [] if enable_events else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """In eviction order (for tests and debugging)."""
        return list(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (free ones leave the free list)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """``n`` blocks from the head of the free list, evicting their cached content."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            b = self.blocks[block_id]
            h = self._evict(b)
            if h is not None:
                evicted.append(h)
            b.ref_cnt = 1
            out.append(b)
        if evicted and self.events is not None:
            self.events.append(BlockRemoved(evicted))
        return out

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free list's tail in order."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise AssertionError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Publish a full block under its chained hash (the first block with a hash keeps it);
        True when the hash is new to the cache."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False  # another block already holds this prefix; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def _evict(self, b: KVBlock) -> BlockHash | None:
        """Drop ``b``'s cached content; the hash the cache lost, if any."""
        h = b.block_hash
        if h is None:
            return None
        b.block_hash = None
        self.num_evictions += 1
        if self._cached.get(h) is b:
            del self._cached[h]
            return h
        return None

    def cached_hashes(self) -> set[BlockHash]:
        """Every hash the cache holds now (tests compare it with what events rebuilt)."""
        return set(self._cached)

    def take_events(self) -> list[KVCacheEvent]:
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
