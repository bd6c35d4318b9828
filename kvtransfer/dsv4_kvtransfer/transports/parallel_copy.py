"""A memory copy spread over several threads, for same-host pulls between two mappings.

One core's ``memcpy`` does not reach the memory bandwidth a few cores do together (each core
has only so many outstanding cache misses). numpy's copy releases the GIL, so pieces copied on
different threads overlap. The pieces are claimed, not assigned: the calling thread copies
pieces too and waits only for pieces a helper already started, so a helper that gets no CPU
(a busy host) costs nothing but its hand-off. Without numpy (a stdlib-only install) the copy is
one ``memoryview`` assignment.

Whether spreading pays depends on the host at the time (an idle core or none, the caches): each
size class (a power of two from ``MIN_PARALLEL``) learns it, keeping the time per byte of both
ways (a moving average) and copying the faster way, the other one every ``EXPLORE``-th time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

MAX_THREADS = 4
PIECE = 512 << 10
# below this one core copies in tens of microseconds: a helper's wake-up costs as much
MIN_PARALLEL = 2 << 20
# below this a copy keeps the GIL (a few microseconds; numpy's wrapping costs as much)
SMALL = 256 << 10
# a size class copies the way it does not prefer every this many times (to notice a change)
EXPLORE = 8

_np: ModuleType | None
try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with the serving extras
    _np = None


def default_threads() -> int:
    """One thread per CPU this process may run on, at most ``MAX_THREADS``."""
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


def _copy(dst: memoryview, src: memoryview) -> None:
    if _np is None or len(dst) < SMALL:
        dst[:] = src
    else:
        _np.copyto(_np.frombuffer(dst, _np.uint8), _np.frombuffer(src, _np.uint8))


class _Job:
    """One copy's pieces, claimed one at a time by the caller and the helpers."""

    def __init__(self, dst: memoryview, src: memoryview) -> None:
        self.dst, self.src = dst, src
        self.n = -(-len(dst) // PIECE)
        self.next = 0
        self.done = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def work(self) -> None:
        while True:
            with self.cond:
                if self.next >= self.n or self.error is not None:
                    return
                i = self.next
                self.next += 1
            lo = i * PIECE
            hi = min(lo + PIECE, len(self.dst))
            try:
                _copy(self.dst[lo:hi], self.src[lo:hi])
            except BaseException as e:
                with self.cond:
                    self.error = e
            with self.cond:
                self.done += 1
                self.cond.notify_all()

    def wait(self) -> None:
        """Until every piece claimed has been copied (none is touched after this returns)."""
        with self.cond:
            while self.done < self.next:
                self.cond.wait()
        if self.error is not None:
            raise self.error


class _Learned:
    """One size class: seconds per byte copying on one thread and spread (0: not tried)."""

    __slots__ = ("cost", "turn")

    def __init__(self) -> None:
        self.cost = [0.0, 0.0]
        self.turn = 0

    def pick(self) -> int:
        """0: one thread, 1: spread."""
        one, spread = self.cost
        if not one or not spread:
            return 0 if not one else 1
        self.turn += 1
        best = 0 if one <= spread else 1
        return 1 - best if self.turn % EXPLORE == 0 else best

    def learn(self, way: int, per_byte: float) -> None:
        old = self.cost[way]
        # a moving average; one preempted copy counts at most 4x the estimate
        self.cost[way] = per_byte if not old else 0.75 * old + 0.25 * min(per_byte, 4 * old)


class ParallelCopy:
    def __init__(self, threads: int = 0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.threads = threads if threads > 0 else default_threads()
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kv-copy")
            if self.threads > 1 and _np is not None
            else None
        )
        self._clock = clock
        self._learned: dict[int, _Learned] = {}
        self.copies = [0, 0]
        """Copies of at least ``MIN_PARALLEL`` bytes made on one thread, and spread."""

    def copy(self, dst: memoryview, src: memoryview) -> None:
        """``dst[:] = src``, on this thread or spread over this thread and the pool's."""
        if len(dst) != len(src):
            raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
        n = len(dst)
        if self._pool is None or n < MIN_PARALLEL:
            _copy(dst, src)
            return
        learned = self._learned.get(n.bit_length())
        if learned is None:
            learned = self._learned.setdefault(n.bit_length(), _Learned())
        way = learned.pick()
        self.copies[way] += 1
        t0 = self._clock()
        if way == 0:
            _copy(dst, src)
        else:
            job = _Job(dst, src)
            for _ in range(min(self.threads - 1, job.n - 1)):
                self._pool.submit(job.work)
            job.work()
            job.wait()
        learned.learn(way, (self._clock() - t0) / n)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
