"""Publish one engine rank's KV event batches: ZMQ PUB, with a replay ROUTER, as vLLM does.

The engine step only enqueues a batch; a background thread numbers, encodes and sends it, and
keeps the last ``buffer_steps`` encoded batches for replay, so publishing is off the step's
critical path. The thread owns both sockets (ZMQ sockets are not thread-safe). The first batch
of every publisher (sequence 0) is ``AllBlocksCleared``: a subscriber that knew an earlier
incarnation of this rank forgets it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque

import zmq

from dsv4_common.kv_events import (
    REPLAY_END,
    AllBlocksCleared,
    KVCacheEvent,
    KVEventBatch,
    encode_batch,
    parse_endpoint,
    rank_endpoints,
    seq_bytes,
    seq_of,
)
from dsv4_serving.engine.config import EngineConfig

log = logging.getLogger(__name__)

_STOP = object()


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "kv",
        data_parallel_rank: int = 0,
        snapshot_bounded: bool = False,
        buffer_steps: int = 10000,
        max_queue: int = 100000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self.snapshot_bounded = snapshot_bounded
        # our sidecar's peer address once its host tier takes offers (set by the engine core)
        self.host_tier: str | None = None
        self.dropped = 0  # batches the step could not enqueue (queue full): logged, counted
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise RuntimeError(f"KV events: cannot bind {endpoint}: {self._error}")
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Enqueue one step's events as a batch (never blocks the step)."""
        batch = KVEventBatch(
            ts=time.time(),
            events=events,  # type: ignore[arg-type]
            data_parallel_rank=self.rank,
            snapshot_bounded=self.snapshot_bounded,
            host_tier=self.host_tier,
        )
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            log.warning("KV events: queue full, dropped a batch (%d so far)", self.dropped)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100000)
        replay = ctx.socket(zmq.ROUTER) if self.replay_endpoint else None
        try:
            pub.bind(self.endpoint)
            if replay is not None:
                assert self.replay_endpoint is not None
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            ctx.term()
            return
        self._ready.set()
        try:
            self._serve(pub, replay)
        finally:
            pub.close(linger=100)
            if replay is not None:
                replay.close(linger=100)
            ctx.term()

    def _serve(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        seq = 0
        while True:
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                assert isinstance(item, KVEventBatch)
                payload = encode_batch(item)
                self._send(pub, seq, payload)
                self._buffer.append((seq, payload))
                seq += 1
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if replay is not None:
                while replay.poll(0):
                    self._replay(replay)

    def _send(self, pub: zmq.Socket[bytes], seq: int, payload: bytes) -> None:
        pub.send_multipart((self.topic, seq_bytes(seq), payload))

    def _replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request; nothing to answer
        client, _, start = frames
        first = seq_of(start) if len(start) == 8 else 0
        for seq, payload in self._buffer:
            if seq >= first:
                replay.send_multipart((client, b"", seq_bytes(seq), payload))
        replay.send_multipart((client, b"", REPLAY_END, b""))


def start_publisher(
    config: EngineConfig, dp_rank: int, snapshot_bounded: bool
) -> ZmqEventPublisher | None:
    """This DP rank's publisher for ``--kv-events-endpoint`` (None when the flag is unset).
    The topic is llm-d's ``kv@<pod address>@<model>`` ($POD_IP, else the endpoint's host)."""
    if config.kv_events_endpoint is None:
        return None
    pub, replay = rank_endpoints(config.kv_events_endpoint, dp_rank)
    host, _ = parse_endpoint(config.kv_events_endpoint)
    topic = f"kv@{os.environ.get('POD_IP') or host}@{config.model_name}"
    return ZmqEventPublisher(pub, replay, topic, dp_rank, snapshot_bounded)
