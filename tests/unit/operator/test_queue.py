"""SyncQueue: coalescing, one sync of an object at a time, per-object exponential back-off."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from dsv4_operator.queue import Backoff, SyncQueue

A, B = ("ns", "a"), ("ns", "b")


def test_backoff_doubles_from_half_a_second_to_five_minutes_per_key() -> None:
    b = Backoff()
    assert [b.failed(A) for _ in range(11)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        32.0,
        64.0,
        128.0,
        256.0,
        300.0,
    ]
    assert b.failed(B) == 0.5
    b.succeeded(A)
    assert b.failures(A) == 0 and b.failed(A) == 0.5


class Recorder:
    """A sync that records its calls, fails while ``failing`` holds keys, and can block."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.failing: set[tuple[str, str]] = set()
        self.gate: threading.Event | None = None

    def __call__(self, namespace: str, name: str) -> None:
        self.calls.append((namespace, name))
        if self.gate is not None:
            self.gate.wait(5)
        if (namespace, name) in self.failing:
            raise RuntimeError("API down")


def _run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_burst_of_events_becomes_one_sync() -> None:
    rec = Recorder()

    async def body() -> None:
        q = SyncQueue(rec, delay_s=0.01)
        for _ in range(5):
            q.enqueue(A)
        q.enqueue(B)
        await q.drain()

    _run(body)
    assert sorted(rec.calls) == [A, B]


def test_an_event_during_a_sync_runs_it_once_more_afterwards() -> None:
    rec = Recorder()
    rec.gate = threading.Event()

    async def body() -> None:
        q = SyncQueue(rec, delay_s=0)
        q.enqueue(A)
        while not rec.calls:
            await asyncio.sleep(0.001)
        q.enqueue(A)  # while the first sync runs
        q.enqueue(A)
        assert rec.calls == [A]  # never two syncs of one object at once
        assert rec.gate is not None
        rec.gate.set()
        await q.drain()

    _run(body)
    assert rec.calls == [A, A]


def test_failures_are_retried_after_growing_delays_until_a_success() -> None:
    rec = Recorder()
    rec.failing.add(A)
    delays: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        delays.append(seconds)
        if len(delays) == 4:
            rec.failing.clear()  # the API server is back before the 4th try
        await asyncio.sleep(0)

    async def body() -> None:
        q = SyncQueue(rec, delay_s=0.2, sleep=fake_sleep)
        q.enqueue(A)
        await q.drain()
        assert q.backoff.failures(A) == 0

    _run(body)
    assert delays == [0.2, 0.5, 1.0, 2.0]
    assert rec.calls == [A, A, A, A]


def test_an_event_brings_a_backed_off_retry_forward() -> None:
    rec = Recorder()
    rec.failing.add(A)

    async def body() -> None:
        q = SyncQueue(rec, delay_s=0, backoff=Backoff(initial_s=60))
        q.enqueue(A)
        while not rec.calls:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # the failure schedules a retry in 60 s
        rec.failing.clear()
        q.enqueue(A)  # an event: sync now, not in a minute
        await q.drain()

    _run(body)
    assert rec.calls == [A, A]


def test_forget_drops_the_back_off_of_a_deleted_object() -> None:
    q_backoff = Backoff()
    q_backoff.failed(A)

    async def body() -> None:
        q = SyncQueue(Recorder(), backoff=q_backoff)
        q.forget(A)

    _run(body)
    assert q_backoff.failures(A) == 0


def test_a_childs_event_syncs_only_a_deployment_the_queue_knows() -> None:
    rec = Recorder()

    async def body() -> None:
        q = SyncQueue(rec, delay_s=0)
        q.enqueue_known(A)  # no event of A itself yet
        q.enqueue(B)
        await q.drain()
        q.enqueue_known(B)
        q.forget(B)  # deleted: its children's events come in as they are collected
        await q.drain()
        q.enqueue_known(B)
        await q.drain()

    _run(body)
    assert rec.calls == [B, B]
