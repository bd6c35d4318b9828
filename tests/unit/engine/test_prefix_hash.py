"""The one prefix-block hash the engine and the gateway share."""

from __future__ import annotations

import hashlib
from array import array

from dsv4_serving.engine.core.prefix_hash import ROOT_HASH, block_hashes, hash_block_tokens


def test_hash_is_sha256_over_parent_and_int64_tokens() -> None:
    want = hashlib.sha256(ROOT_HASH + array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert hash_block_tokens(None, [1, 2, 3, 4]) == want


def test_chain_names_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different prefix
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])


def test_partial_trailing_block_has_no_hash_and_extra_separates_caches() -> None:
    assert len(block_hashes(list(range(11)), 4)) == 2
    assert block_hashes([1] * 4, 4, extra=b"x") != block_hashes([1] * 4, 4)
