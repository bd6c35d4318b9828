"""The block pool: exact block ids, free-list order, prefix-cache hits and eviction."""

from __future__ import annotations

import pytest

from dsv4_serving.engine.core.block_pool import BlockPool
from dsv4_serving.engine.core.prefix_hash import block_hashes


def ids(blocks):  # type: ignore[no-untyped-def]
    return [b.block_id for b in blocks]


def test_new_blocks_come_from_the_head_in_id_order() -> None:
    pool = BlockPool(6)
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert pool.free_block_ids() == [5]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_freed_blocks_join_the_tail_in_the_given_order() -> None:
    pool = BlockPool(5)
    a = pool.get_new_blocks(3)  # 0 1 2
    pool.free_blocks(reversed(a))  # a request frees last-first
    assert pool.free_block_ids() == [3, 4, 2, 1, 0]
    assert ids(pool.get_new_blocks(3)) == [3, 4, 2]


def test_shared_block_is_free_only_after_the_last_reference() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert pool.free_block_ids() == [1, 2, 0]
    with pytest.raises(AssertionError):
        pool.free_blocks([b])


def test_prefix_hit_reuses_a_freed_cached_block_and_takes_it_off_the_free_list() -> None:
    pool = BlockPool(4)
    h = block_hashes(list(range(8)), 4)
    a = pool.get_new_blocks(2)  # 0 1
    pool.cache_block(a[0], h[0])
    pool.cache_block(a[1], h[1])
    pool.free_blocks(reversed(a))
    assert pool.free_block_ids() == [2, 3, 1, 0]
    hit = pool.get_cached_block(h[0])
    assert hit is not None and hit.block_id == 0
    pool.touch([hit])
    assert pool.free_block_ids() == [2, 3, 1]
    assert ids(pool.get_new_blocks(2)) == [2, 3]


def test_reusing_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    h = block_hashes(list(range(4)), 4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h[0])
    pool.free_blocks([b])
    assert pool.free_block_ids() == [1, 0]
    assert ids(pool.get_new_blocks(2)) == [1, 0]
    assert pool.get_cached_block(h[0]) is None
    assert pool.num_evictions == 1


def test_a_second_block_with_the_same_hash_stays_private() -> None:
    pool = BlockPool(2)
    h = block_hashes(list(range(4)), 4)[0]
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(2, enable_caching=False)
    h = block_hashes(list(range(4)), 4)[0]
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h)
    assert pool.get_cached_block(h) is None
