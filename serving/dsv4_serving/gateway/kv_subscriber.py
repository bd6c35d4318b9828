"""Feed each instance's precise prefix index (``kv_index.RankCache``, one per DP rank) from its
engine's KV events: a ZMQ SUB on the rank's publisher and, for resynchronisation, a DEALER on
its replay socket (docs/cluster-kv.md). One asyncio task per (instance, rank), on the gateway's
event loop, so the index is only ever touched from that loop.

An instance's events endpoint is ``--kv-events URL=tcp://HOST:PORT`` when listed, else, with
``--kv-events-port P``, ``tcp://<the instance URL's host>:P`` (every engine pod publishing on
the same port, as the operator renders it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from dsv4_common.kv_events import (
    REPLAY_END,
    KVEventBatch,
    decode_batch,
    rank_endpoints,
    seq_bytes,
    seq_of,
)
from dsv4_serving.gateway.instances import Instance, InstancePool
from dsv4_serving.gateway.kv_index import Live, RankCache, on_live
from dsv4_serving.gateway.metrics import GatewayMetrics

log = logging.getLogger("dsv4.gateway")

REPLAY_TIMEOUT_S = 2.0


def endpoint_of(inst: Instance, explicit: dict[str, str], port: int) -> str | None:
    if inst.url in explicit:
        return explicit[inst.url]
    if port:
        return f"tcp://{urlsplit(inst.url).hostname}:{port}"
    return None


class KVEventFeeds:
    def __init__(
        self, pool: InstancePool, explicit: dict[str, str], port: int, metrics: GatewayMetrics
    ) -> None:
        self.pool, self.explicit, self.port, self.metrics = pool, explicit, port, metrics
        self.ctx = zmq.asyncio.Context()
        self._tasks: dict[tuple[str, int], tuple[str, asyncio.Task[None]]] = {}
        # the engines' block size, from their events: the gateway hashes prompts with it
        self.block_size: int | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.explicit or self.port)

    def sync(self) -> None:
        """Follow every member's ranks; stop following those that left or changed endpoint."""
        wanted: dict[tuple[str, int], tuple[str, Instance]] = {}
        for inst in self.pool.all():
            endpoint = endpoint_of(inst, self.explicit, self.port)
            if endpoint is None:
                continue
            if (
                inst.kv_events != endpoint
                or inst.kv_ranks is None
                or (len(inst.kv_ranks) != inst.dp_size)
            ):
                inst.kv_events = endpoint
                inst.kv_ranks = [RankCache() for _ in range(inst.dp_size)]
            for r in range(inst.dp_size):
                wanted[inst.url, r] = (endpoint, inst)
        for key, (endpoint, task) in list(self._tasks.items()):
            if key not in wanted or wanted[key][0] != endpoint or task.done():
                task.cancel()
                del self._tasks[key]
        for (url, r), (endpoint, inst) in wanted.items():
            if (url, r) not in self._tasks:
                assert inst.kv_ranks is not None
                task = asyncio.create_task(self._follow(url, r, endpoint, inst.kv_ranks[r]))
                self._tasks[url, r] = (endpoint, task)

    async def run(self, interval_s: float = 1.0) -> None:
        try:
            while True:
                self.sync()
                await asyncio.sleep(interval_s)
        finally:
            for _, task in self._tasks.values():
                task.cancel()
            self._tasks.clear()
            self.ctx.destroy(linger=0)

    async def _follow(self, url: str, rank: int, endpoint: str, cache: RankCache) -> None:
        """Every (re)connection to the publisher replays its ring (what was published while
        not connected, a restarted engine's fresh history); then the live stream."""
        pub, replay = rank_endpoints(endpoint, rank)
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(pub)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    while not await self._resync(url, rank, replay, cache):
                        await asyncio.sleep(1.0)
                if sub in ready:
                    await self._on_batch(url, rank, replay, cache, await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_batch(
        self, url: str, rank: int, replay: str, cache: RankCache, frames: list[bytes]
    ) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            return
        seq = seq_of(frames[1])
        try:
            batch = decode_batch(frames[2])
        except msgspec.DecodeError as exc:
            log.warning("KV events from %s rank %d: bad batch %d: %s", url, rank, seq, exc)
            return
        how = on_live(seq, cache.expected, cache.replayed_from)
        if how is Live.RESYNC:
            await self._resync(url, rank, replay, cache)
            how = on_live(seq, cache.expected, cache.replayed_from)
        if how is Live.APPLY:
            cache.apply(seq, batch)
        self._learn_block_size(url, cache)

    def _learn_block_size(self, url: str, cache: RankCache) -> None:
        bs = cache.block_size
        if bs is None or bs == self.block_size:
            return
        if self.block_size is not None:
            log.warning(
                "KV events: %s uses %d-token blocks, others %d: prompts are hashed with %d, "
                "its ranks score no cached tokens",
                url,
                bs,
                self.block_size,
                self.block_size,
            )
            return
        self.block_size = bs

    async def _resync(self, url: str, rank: int, endpoint: str, cache: RankCache) -> bool:
        """Replay the rank's ring from 0 into ``cache``; False when it did not answer."""
        got = await self._replay(endpoint)
        if got is None:
            return False
        how = cache.resync(got)
        self._learn_block_size(url, cache)
        if how is not None:
            self.metrics.kv_resyncs.labels(url, str(rank), how.value).inc()
            log.info("KV events from %s rank %d: resync (%s)", url, rank, how.value)
        return how is not None

    async def _replay(self, endpoint: str) -> list[tuple[int, KVEventBatch]] | None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        out: list[tuple[int, KVEventBatch]] = []
        try:
            await sock.send_multipart((b"", seq_bytes(0)))
            while True:
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    frames = await sock.recv_multipart()
                if len(frames) != 3 or frames[1] == REPLAY_END:
                    return out
                with contextlib.suppress(msgspec.DecodeError):
                    out.append((seq_of(frames[1]), decode_batch(frames[2])))
        except TimeoutError:
            return None
        finally:
            sock.close(linger=0)
