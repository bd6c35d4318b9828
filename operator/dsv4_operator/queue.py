"""Coalesce sync requests per object: a burst of events becomes one sync, never two at once; a
failed sync is retried after a per-object exponential back-off (reset by a success), as
controller-runtime's workqueue does. An event still syncs promptly during a back-off."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("dsv4.operator")

Key = tuple[str, str]  # (namespace, name)


class Retry(Exception):
    """Raised by a sync that did all it could (it reported the problem) but must run again,
    after the back-off: logged as one line, not as a failure with a traceback."""


class Backoff:
    """Delay before the n-th retry of one key: ``initial_s * 2**(n-1)``, at most ``max_s``."""

    def __init__(self, initial_s: float = 0.5, max_s: float = 300.0) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._failures: dict[Key, int] = {}

    def failed(self, key: Key) -> float:
        n = self._failures.get(key, 0) + 1
        self._failures[key] = n
        return float(min(self.initial_s * 2 ** (n - 1), self.max_s))

    def succeeded(self, key: Key) -> None:
        self._failures.pop(key, None)

    def failures(self, key: Key) -> int:
        return self._failures.get(key, 0)


class SyncQueue:
    def __init__(
        self,
        sync: Callable[[str, str], None],
        *,
        delay_s: float = 0.2,
        backoff: Backoff | None = None,
        max_concurrent: int = 8,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._sync = sync
        self._delay = delay_s
        self.backoff = backoff or Backoff()
        self._sleep = sleep
        self._scheduled: dict[Key, tuple[float, asyncio.Task[None]]] = {}  # due (monotonic)
        self._running: set[Key] = set()
        self._again: set[Key] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.known: set[Key] = set()
        self._limit = asyncio.Semaphore(max_concurrent)
        # syncs block on HTTP: a pool of their own, as wide as the limit (the default pool has
        # cpu_count + 4 threads, fewer than the limit on a small node)
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="sync")
        self._lock = threading.Lock()
        self._in_threads = 0

    def enqueue(self, key: Key, delay_s: float | None = None) -> None:
        """Sync ``key`` after ``delay_s`` (default: the coalescing delay); a sync already due
        sooner stands, one due later (a back-off) is brought forward."""
        self.known.add(key)
        if key in self._running:
            self._again.add(key)  # events during a sync: run once more afterwards
            return
        delay = self._delay if delay_s is None else delay_s
        due = time.monotonic() + delay
        scheduled = self._scheduled.get(key)
        if scheduled is not None:
            if scheduled[0] <= due:
                return
            scheduled[1].cancel()
        task = asyncio.get_running_loop().create_task(self._run(key, delay))
        self._scheduled[key] = (due, task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def enqueue_known(self, key: Key, delay_s: float | None = None) -> None:
        """``enqueue`` for a deployment this queue has seen an event of, and that was not deleted
        since: a child's event never resurrects a deleted one (its children are being collected),
        and before its own first event its children cannot matter yet (that event syncs it)."""
        if key in self.known:
            self.enqueue(key, delay_s)

    def forget(self, key: Key) -> None:
        self._again.discard(key)
        self.known.discard(key)
        self.backoff.succeeded(key)

    def enqueue_all(self) -> None:
        """Sync every known object again (a cluster-wide fact they depend on changed)."""
        for key in list(self.known):
            self.enqueue(key)

    async def _run(self, key: Key, delay: float) -> None:
        await self._sleep(delay)
        async with self._limit:
            self._scheduled.pop(key, None)
            self._running.add(key)
            retry: float | None = None
            try:
                await asyncio.get_running_loop().run_in_executor(self._pool, self._call, *key)
                self.backoff.succeeded(key)
            except Retry as e:
                retry = self.backoff.failed(key)
                log.warning("sync of %s/%s: %s; again in %.1fs", *key, e, retry)
            except Exception:
                retry = self.backoff.failed(key)
                log.exception("sync of %s/%s failed; retrying in %.1fs", *key, retry)
            finally:
                self._running.discard(key)
        again = key in self._again
        self._again.discard(key)
        if retry is not None:
            self.enqueue(key, retry)  # the retry reads the newest state anyway
        elif again:
            self.enqueue(key)

    def idle(self) -> bool:
        """No sync is running in a thread (a cancelled wait for one does not end it)."""
        with self._lock:
            return self._in_threads == 0

    def _call(self, namespace: str, name: str) -> None:
        with self._lock:
            self._in_threads += 1
        try:
            self._sync(namespace, name)
        finally:
            with self._lock:
                self._in_threads -= 1

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
