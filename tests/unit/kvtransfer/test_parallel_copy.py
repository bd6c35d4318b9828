"""The shm transport's copy: the same bytes whatever the size and thread count, pieces claimed
by whoever is free, errors raised in the caller."""

from __future__ import annotations

import os

import pytest

from dsv4_kvtransfer.transports.parallel_copy import MIN_PARALLEL, PIECE, ParallelCopy


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(
    "nbytes", [0, 4097, MIN_PARALLEL - 1, MIN_PARALLEL, MIN_PARALLEL + 5 * PIECE + 12345]
)
def test_copies_every_byte(threads: int, nbytes: int) -> None:
    src = os.urandom(nbytes)
    dst = bytearray(nbytes + 8)  # bytes past the range stay untouched
    pc = ParallelCopy(threads)
    try:
        pc.copy(memoryview(dst)[:nbytes], memoryview(src))
    finally:
        pc.close()
    assert bytes(dst[:nbytes]) == src and dst[nbytes:] == bytearray(8)


def test_a_size_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="copy of 10 bytes into 9"):
        ParallelCopy(2).copy(memoryview(bytearray(9)), memoryview(bytes(10)))


def test_a_failing_piece_raises_in_the_caller() -> None:
    src = bytes(MIN_PARALLEL + PIECE)
    read_only = memoryview(bytes(len(src)))
    pc = ParallelCopy(2)
    try:
        with pytest.raises(ValueError, match="read-only"):
            pc.copy(read_only, memoryview(src))
    finally:
        pc.close()
