"""KV events from real engines, read by real ZMQ sockets: a request's blocks and boundary
snapshot are announced, evicting them is announced, replay from a sequence number returns
exactly the batches published since, a fresh subscriber's replay rebuilds the engine's cache
exactly, and each DP rank publishes its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from dsv4_common.kv_events import (
    REPLAY_END,
    SNAPSHOT_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    rank_endpoints,
    seq_bytes,
    seq_of,
    snapshot_hash,
)
from dsv4_common.process import Service, free_ports
from dsv4_serving.engine.core.prefix_hash import block_hashes
from tests.engine.common import start_engine

BS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str]]:
    endpoint = f"tcp://127.0.0.1:{free_ports(2, set())}"  # PUB on PORT, replay on PORT + 1
    args = ("--model", "dsv4-tiny", "--served-model-name", "tiny", "--block-size", str(BS))
    args += ("--max-model-len", "128", "--num-kv-blocks", "16", "--num-speculative-tokens", "0")
    args += ("--max-num-seqs", "2", "--kv-events-endpoint", endpoint)
    server = start_engine("events", tmp_path_factory.mktemp("engine"), *args)
    try:
        server.wait_ready(180)
        yield server, endpoint
    finally:
        server.stop()


def _complete(server: Service, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def _replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.connect(endpoint)
        sock.send_multipart((b"", seq_bytes(start)))
        out = []
        while True:
            assert sock.poll(10000), "replay did not answer"
            _, seq, payload = sock.recv_multipart()
            if seq == REPLAY_END:
                return out
            out.append((seq_of(seq), payload))


class _Sub:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sock.connect(endpoint)
        self.got: list[tuple[int, bytes]] = []

    def until(self, done: object, timeout_s: float = 60) -> list[KVEventBatch]:
        """Batches received until ``done(batches so far)`` is true."""
        batches: list[KVEventBatch] = []
        deadline = time.monotonic() + timeout_s
        while not done(batches):  # type: ignore[operator]
            assert self.sock.poll(max(1, int(1000 * (deadline - time.monotonic())))), "no event"
            _, seq, payload = self.sock.recv_multipart()
            self.got.append((seq_of(seq), payload))
            batches.append(decode_batch(payload))
        return batches


def _hashes(batches: list[KVEventBatch], kind: type, group: int | None) -> list[bytes]:
    return [
        h
        for b in batches
        for e in b.events
        if isinstance(e, kind) and getattr(e, "group_idx", None) == group
        for h in e.block_hashes
    ]


def test_blocks_stored_evicted_and_replayed(engine: tuple[Service, str]) -> None:
    server, endpoint = engine
    pub, replay = rank_endpoints(endpoint, 0)
    sub = _Sub(pub)
    # the publisher's first batch was sent before anyone listened: replay has it
    first = _replay(replay, 0)
    assert first[0][0] == 0 and decode_batch(first[0][1]).events == [AllBlocksCleared()]
    time.sleep(0.5)  # the subscription reaches the publisher

    a = [(7 * i + 3) % 200 for i in range(70)]  # 4 full blocks of 16, 6 tokens left
    ha = block_hashes(a, BS)
    _complete(server, a)
    got = sub.until(lambda bs: set(ha) <= set(_hashes(bs, BlockStored, None)))
    assert all(b.data_parallel_rank == 0 and b.snapshot_bounded for b in got)
    stored = [
        e for b in got for e in b.events if isinstance(e, BlockStored) and e.group_idx is None
    ]
    assert [h for e in stored for h in e.block_hashes] == ha
    assert stored[0].parent_block_hash is None and stored[0].token_ids[:BS] == a[:BS]
    # the prompt's deepest boundary (64) has a snapshot, keyed without a next token (no MTP)
    sub.until(lambda bs: snapshot_hash(ha[3]) in _hashes(got + bs, BlockStored, SNAPSHOT_GROUP))

    # other prompts fill the 16-block pool: a's blocks are evicted and announced
    for k in range(1, 6):
        _complete(server, [(11 * i + 5 * k) % 200 for i in range(100)])
    sub.until(lambda bs: set(ha) <= set(_hashes(bs, BlockRemoved, None)))

    # replay from a sequence number: exactly what the subscriber saw from there on
    # (the engine may have published more since: those come after)
    mid = sub.got[len(sub.got) // 2][0]
    seen = [(s, p) for s, p in sub.got if s >= mid]
    assert _replay(replay, mid)[: len(seen)] == seen
    assert [s for s, _ in sub.got] == list(range(sub.got[0][0], sub.got[-1][0] + 1))


def test_a_fresh_subscriber_rebuilds_the_cache_exactly_after_evictions() -> None:
    """An in-process core (MTP on: snapshot keys carry the next token) runs a mixed workload
    with a shared prefix on a pool small enough to evict; then a subscriber that never saw the
    live stream replays the ring from 0 into the gateway's index: its blocks and snapshot keys
    are exactly the engine's cached hashes and published snapshots."""
    from dsv4_serving.engine.config import EngineConfig
    from dsv4_serving.engine.engine.engine_core import EngineCore
    from dsv4_serving.gateway.kv_index import RankCache
    from tests.engine.common import run, workload

    endpoint = f"tcp://127.0.0.1:{free_ports(2, set())}"
    config = EngineConfig(
        model="dsv4-tiny",
        max_model_len=256,
        num_kv_blocks=48,
        max_num_seqs=4,
        block_size=BS,
        kv_events_endpoint=endpoint,
    )
    core = EngineCore(config)
    try:
        run(core, workload(16, 3, shared_prefix=50), waves=4)
        kv = core.kv
        assert kv.pool.num_evictions > 0 and kv.key_next_token
        _, replay = rank_endpoints(endpoint, 0)
        ring = _replay(replay, 0)
        for _ in range(50):  # the publisher thread may still be sending the last steps
            time.sleep(0.1)
            again = _replay(replay, 0)
            if len(again) == len(ring):
                break
            ring = again
        cache = RankCache()
        assert cache.resync([(s, decode_batch(p)) for s, p in ring]) is not None
        assert cache.blocks == kv.pool.cached_hashes() and cache.blocks
        assert cache.snapshots == {snapshot_hash(b, n) for b, n in kv._boundaries}
        assert cache.snapshot_bounded
        assert any(n >= 0 for _, n in kv._boundaries)  # keys with the next token
    finally:
        core.close()


def test_each_dp_rank_publishes_its_own_cache(tmp_path: Path) -> None:
    """Two DP ranks: each publishes on its own ports, tagged with its rank; a request the
    front end sends to rank 1 is announced by rank 1 alone."""
    endpoint = f"tcp://127.0.0.1:{free_ports(4, set())}"  # rank r: PORT + 2r and PORT + 2r + 1
    args = ("--model", "dsv4-tiny", "--served-model-name", "tiny", "--block-size", str(BS))
    args += ("--max-model-len", "128", "--num-kv-blocks", "32", "--data-parallel-size", "2")
    server = start_engine("events-dp", tmp_path, *args, "--kv-events-endpoint", endpoint)
    try:
        server.wait_ready(600)
        subs = []
        for rank in (0, 1):
            pub, replay = rank_endpoints(endpoint, rank)
            (first,) = _replay(replay, 0)[:1]
            batch = decode_batch(first[1])
            assert (first[0], batch.data_parallel_rank, batch.events) == (
                0,
                rank,
                [AllBlocksCleared()],
            )
            subs.append(_Sub(pub))
        time.sleep(0.5)
        prompt = [(3 * i + 2) % 200 for i in range(40)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(
            f"{server.url}/v1/completions",
            json=body,
            headers={"x-data-parallel-rank": "1"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        h = block_hashes(prompt, BS)
        got = subs[1].until(lambda bs: set(h) <= set(_hashes(bs, BlockStored, None)))
        assert {b.data_parallel_rank for b in got} == {1}
        assert not subs[0].sock.poll(500)  # rank 0 stored nothing
    finally:
        server.stop()
