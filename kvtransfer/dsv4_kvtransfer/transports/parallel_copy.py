"""A memory copy spread over several threads, for same-host pulls between two mappings.

One core's ``memcpy`` does not reach the memory bandwidth a few cores do together (each core
has only so many outstanding cache misses). numpy's copy releases the GIL, so pieces copied on
different threads overlap. The pieces are claimed, not assigned: the calling thread copies
pieces too and waits only for pieces a helper already started, so a helper that gets no CPU
(a busy host) costs nothing but its hand-off. Without numpy (a stdlib-only install) the copy is
one ``memoryview`` assignment.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

MAX_THREADS = 4
PIECE = 1 << 20
# below this one core copies in well under a millisecond: a helper's wake-up (and, on a busy
# host, waiting for a helper preempted mid-piece) costs more than its share saves
MIN_PARALLEL = 16 << 20

_np: ModuleType | None
try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with the serving extras
    _np = None


def default_threads() -> int:
    """One thread per CPU this process may run on, at most ``MAX_THREADS``."""
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


def _copy(dst: memoryview, src: memoryview) -> None:
    if _np is None:
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


class ParallelCopy:
    def __init__(self, threads: int = 0) -> None:
        self.threads = threads if threads > 0 else default_threads()
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kv-copy")
            if self.threads > 1 and _np is not None
            else None
        )

    def copy(self, dst: memoryview, src: memoryview) -> None:
        """``dst[:] = src``, spread over this thread and the pool's."""
        if len(dst) != len(src):
            raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
        if self._pool is None or len(dst) < MIN_PARALLEL:
            _copy(dst, src)
            return
        job = _Job(dst, src)
        for _ in range(min(self.threads - 1, job.n - 1)):
            self._pool.submit(job.work)
        job.work()
        job.wait()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
