from __future__ import annotations

import pytest

from dsv4_kvtransfer.allocator import ExtentAllocator


def test_first_fit_with_alignment_and_exact_free_space() -> None:
    a = ExtentAllocator(4096, 10 * 4096 + 100)  # the tail under one unit is unusable
    assert a.size == 40960 and a.free_bytes == 40960
    assert a.alloc(1) == 4096  # one unit minimum
    assert a.alloc(4097) == 8192  # two units
    assert a.alloc(0) == 16384
    assert a.used_bytes == 4 * 4096 and a.free_bytes == 6 * 4096
    assert a.alloc(7 * 4096) is None  # does not fit
    assert a.free_extents() == [(20480, 24576)]


def test_freeing_coalesces_back_to_one_extent() -> None:
    a = ExtentAllocator(0, 8 * 4096)
    offs = [a.alloc(4096) for _ in range(4)]
    assert offs == [0, 4096, 8192, 12288]
    assert a.free(4096) == 4096
    assert a.free(12288) == 4096
    assert a.free_extents() == [(4096, 4096), (12288, 20480)]
    assert a.alloc(8192) == 12288  # first fit skips the one-unit hole
    assert a.free(8192) == 4096  # merges with the hole before it
    assert a.free_extents() == [(4096, 8192), (20480, 12288)]
    a.free(0)
    a.free(12288)
    assert a.free_extents() == [(0, 8 * 4096)] and a.used_bytes == 0
    assert a.largest_free == 8 * 4096


def test_double_free_is_a_bug() -> None:
    a = ExtentAllocator(0, 4096)
    off = a.alloc(10)
    assert off == 0
    a.free(off)
    with pytest.raises(ValueError, match="not an allocated extent"):
        a.free(off)
    with pytest.raises(ValueError):
        ExtentAllocator(100, 4096)
