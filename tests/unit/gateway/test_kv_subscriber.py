"""The gateway's KV event feed against a real publisher on 127.0.0.1: it catches up on what
was published before it listened, follows the live stream, and a batch lost in transport (a
sequence gap) is recovered by replay; a restarted publisher clears what the old one held."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest
import zmq

from dsv4_common.kv_events import BlockRemoved, BlockStored
from dsv4_common.process import free_port
from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.engine.kv_events.publisher import ZmqEventPublisher
from dsv4_serving.gateway.instances import InstancePool
from dsv4_serving.gateway.kv_index import RankCache
from dsv4_serving.gateway.kv_subscriber import KVEventFeeds
from dsv4_serving.gateway.metrics import GatewayMetrics

URL = "http://127.0.0.1:9"
H = block_hashes(list(range(40)), 4)


class _Lossy(ZmqEventPublisher):
    """Drops the live copy of the batches numbered in ``lost`` (the replay ring keeps them)."""

    lost: frozenset[int] = frozenset()

    def _send(self, pub: zmq.Socket[bytes], seq: int, payload: bytes) -> None:
        if seq not in self.lost:
            super()._send(pub, seq, payload)


def _start(port: int, lost: frozenset[int] = frozenset(), ring: int = 10000) -> _Lossy:
    _Lossy.lost = lost
    return _Lossy(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", buffer_steps=ring)


def _stored(i: int) -> list:  # type: ignore[type-arg]
    return [BlockStored([H[i]], H[i - 1] if i else None, list(range(4 * i, 4 * i + 4)), 4)]


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the feed did not get there"
        await asyncio.sleep(0.02)


def _free_pair() -> int:
    while True:  # two consecutive free ports: the publisher's and its replay's
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.mark.parametrize(("ring", "second"), [(10000, "rebuild"), (3, "continue")])
def test_feed_catches_up_follows_and_recovers_a_lost_batch(ring: int, second: str) -> None:
    """The gap's replay rebuilds from batch 0 while the ring still holds it, else continues
    from the batch expected next (a ring of 3 holds 2..4 then)."""
    port = _free_pair()
    pub = _start(port, lost=frozenset({3}), ring=ring)
    metrics = GatewayMetrics()

    async def run() -> RankCache:
        pool = InstancePool()
        pool.set_members("both", [URL])
        pub.publish(_stored(0))  # seq 1, before the gateway listens
        feeds = KVEventFeeds(pool, {URL: f"tcp://127.0.0.1:{port}"}, 0, metrics)
        task = asyncio.create_task(feeds.run(interval_s=0.05))
        inst = pool.get(URL)
        assert inst is not None
        await _until(lambda: inst.kv_ranks is not None and inst.kv_ranks[0].expected == 2)
        assert inst.kv_ranks is not None
        cache = inst.kv_ranks[0]
        assert cache.blocks == {H[0]}  # from the replay: rebuilt from batch 0
        await asyncio.sleep(0.3)  # the SUB's subscription reaches the publisher
        pub.publish(_stored(1))  # seq 2: live
        await _until(lambda: cache.expected == 3)
        pub.publish(_stored(2))  # seq 3: lost in transport
        pub.publish([*_stored(3), BlockRemoved([H[0]])])  # seq 4: a gap -> replay
        await _until(lambda: cache.expected == 5)
        assert feeds.block_size == 4  # learned from the events
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return cache

    try:
        cache = asyncio.run(run())
    finally:
        pub.close()
    assert cache.blocks == {H[1], H[2], H[3]}
    assert (cache.resyncs, cache.lossy_resyncs) == (2, 0)
    kinds = {
        s.labels["kind"]: s.value
        for f in metrics.registry.collect()
        for s in f.samples
        if s.name == "dsv4_gateway_kv_events_resyncs_total"
    }
    assert kinds == ({"rebuild": 2.0} if second == "rebuild" else {"rebuild": 1.0, second: 1.0})


def test_a_restarted_publisher_clears_the_old_ones_blocks() -> None:
    port = _free_pair()

    async def run() -> RankCache:
        pool = InstancePool()
        pool.set_members("both", [URL])
        feeds = KVEventFeeds(pool, {URL: f"tcp://127.0.0.1:{port}"}, 0, GatewayMetrics())
        first = _start(port)
        first.publish(_stored(0))
        first.publish(_stored(1))
        task = asyncio.create_task(feeds.run(interval_s=0.05))
        inst = pool.get(URL)
        assert inst is not None
        await _until(lambda: inst.kv_ranks is not None and inst.kv_ranks[0].expected == 3)
        assert inst.kv_ranks is not None
        cache = inst.kv_ranks[0]
        first.close()
        second = _start(port)  # the engine restarted: sequence 0 again, an empty cache
        try:
            second.publish(_stored(5))
            await _until(lambda: cache.blocks == {H[5]})
        finally:
            second.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return cache

    cache = asyncio.run(run())
    assert cache.blocks == {H[5]} and cache.expected == 2
