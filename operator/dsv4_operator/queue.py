"""Coalesce sync requests per object: a burst of events becomes one sync, never two at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("dsv4.operator")

Key = tuple[str, str]  # (namespace, name)


class SyncQueue:
    def __init__(
        self,
        sync: Callable[[str, str], None],
        *,
        delay_s: float = 0.2,
        retry_s: float = 5.0,
        max_concurrent: int = 8,
    ) -> None:
        self._sync = sync
        self._delay = delay_s
        self._retry = retry_s
        self._scheduled: set[Key] = set()
        self._running: set[Key] = set()
        self._again: set[Key] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.known: set[Key] = set()
        self._limit = asyncio.Semaphore(max_concurrent)

    def enqueue(self, key: Key, delay_s: float | None = None) -> None:
        self.known.add(key)
        if key in self._running:
            self._again.add(key)  # events during a sync: run once more afterwards
            return
        if key in self._scheduled:
            return
        self._scheduled.add(key)
        task = asyncio.get_running_loop().create_task(
            self._run(key, self._delay if delay_s is None else delay_s)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget(self, key: Key) -> None:
        self._again.discard(key)
        self.known.discard(key)

    def enqueue_all(self) -> None:
        """Sync every known object again (a cluster-wide fact they depend on changed)."""
        for key in list(self.known):
            self.enqueue(key)

    async def _run(self, key: Key, delay: float) -> None:
        await asyncio.sleep(delay)
        async with self._limit:
            self._scheduled.discard(key)
            self._running.add(key)
            retry = False
            try:
                await asyncio.to_thread(self._sync, *key)
            except Exception:
                log.exception("sync of %s/%s failed; retrying in %.0fs", *key, self._retry)
                retry = True
            finally:
                self._running.discard(key)
        if retry:
            self.enqueue(key, self._retry)
        elif key in self._again:
            self._again.discard(key)
            self.enqueue(key)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
