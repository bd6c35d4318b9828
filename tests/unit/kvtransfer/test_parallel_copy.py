"""The shm transport's copy: the same bytes whatever the size and thread count, pieces claimed
by whoever is free, errors raised in the caller."""

from __future__ import annotations

import os

import pytest

from dsv4_kvtransfer.transports.parallel_copy import EXPLORE, MIN_PARALLEL, PIECE, ParallelCopy


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(
    "nbytes", [0, 4097, MIN_PARALLEL - 1, MIN_PARALLEL, MIN_PARALLEL + 5 * PIECE + 12345]
)
def test_copies_every_byte(threads: int, nbytes: int) -> None:
    src = os.urandom(nbytes)
    pc = ParallelCopy(threads)
    try:
        for _ in range(3):  # from a size class's third copy, both ways were tried
            dst = bytearray(nbytes + 8)  # bytes past the range stay untouched
            pc.copy(memoryview(dst)[:nbytes], memoryview(src))
            assert bytes(dst[:nbytes]) == src and dst[nbytes:] == bytearray(8)
    finally:
        pc.close()


def test_a_size_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="copy of 10 bytes into 9"):
        ParallelCopy(2).copy(memoryview(bytearray(9)), memoryview(bytes(10)))


def test_a_failing_piece_raises_in_the_caller() -> None:
    src = bytes(MIN_PARALLEL + PIECE)
    read_only = memoryview(bytes(len(src)))
    pc = ParallelCopy(2, clock=Durations([8e-3, 1e-3]))
    try:
        pc.copy(memoryview(bytearray(len(src))), memoryview(src))  # one thread: slow
        pc.copy(memoryview(bytearray(len(src))), memoryview(src))  # spread: faster
        with pytest.raises(ValueError, match="read-only"):
            pc.copy(read_only, memoryview(src))  # spread, failing in a piece
        assert pc.copies == [1, 2]
    finally:
        pc.close()


class Durations:
    """A clock under which each copy takes the next of ``durations`` seconds."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = iter(durations)
        self.now = 0.0
        self.started = False

    def __call__(self) -> float:
        if self.started:
            self.now += next(self.durations)
        self.started = not self.started
        return self.now


def test_each_size_class_copies_the_faster_way_and_tries_the_other_now_and_then() -> None:
    nbytes = MIN_PARALLEL + 3 * PIECE + 7  # the same power of two as MIN_PARALLEL
    src = os.urandom(nbytes)
    # one thread: 8 ms, spread: 1 ms (the first copy tries one thread, the second spreads)
    pc = ParallelCopy(2, clock=Durations([8e-3, 1e-3] + [1e-3] * 16))
    try:
        for _ in range(18):
            dst = bytearray(nbytes)
            pc.copy(memoryview(dst), memoryview(src))
            assert bytes(dst) == src
        # spread from the second on, except every EXPLORE-th turn after both were tried
        assert pc.copies == [1 + 16 // EXPLORE, 17 - 16 // EXPLORE]
        # another size class learns on its own: it starts on one thread
        pc._clock = Durations([1e-3])
        pc.copy(memoryview(bytearray(2 * MIN_PARALLEL)), memoryview(bytes(2 * MIN_PARALLEL)))
        assert pc.copies[0] == 2 + 16 // EXPLORE
    finally:
        pc.close()


def test_below_the_threshold_or_on_one_thread_nothing_is_learned() -> None:
    pc = ParallelCopy(1)
    pc.copy(memoryview(bytearray(MIN_PARALLEL)), memoryview(bytes(MIN_PARALLEL)))
    assert pc.copies == [0, 0]
    pc = ParallelCopy(2)
    try:
        pc.copy(memoryview(bytearray(MIN_PARALLEL - 1)), memoryview(bytes(MIN_PARALLEL - 1)))
        assert pc.copies == [0, 0]
    finally:
        pc.close()
