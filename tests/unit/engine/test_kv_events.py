"""KV events: the schema's wire form, what the block pool and KV cache manager record, and the
ZMQ publisher's numbering and replay (real sockets on 127.0.0.1)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
import zmq

from dsv4_common.kv_events import (
    REPLAY_END,
    SNAPSHOT_GROUP,
    SNAPSHOT_KIND,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    rank_endpoints,
    seq_bytes,
    seq_of,
    snapshot_hash,
)
from dsv4_common.process import free_port
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, Scheduler, SchedulerConfig
from dsv4_serving.engine.kv_events.publisher import ZmqEventPublisher
from tests.unit.engine.test_scheduler import BS, FakeRunner, add, drive


# vLLM's subscriber-side types, as its example subscriber declares them
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):  # type: ignore[call-arg]
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]  # type: ignore[assignment]


def test_batch_round_trips_and_decodes_with_vllms_own_structs() -> None:
    h = block_hashes(list(range(8)), 4)
    batch = KVEventBatch(
        ts=12.5,
        events=[BlockStored(h, None, list(range(8)), 4), BlockRemoved([h[1]]), AllBlocksCleared()],
        data_parallel_rank=1,
        snapshot_bounded=True,
    )
    assert decode_batch(encode_batch(batch)) == batch

    # vLLM's subscriber-side types (fields up to medium; no snapshot_bounded): still decodes
    got = msgspec.msgpack.Decoder(VKVEventBatch).decode(encode_batch(batch))
    assert got.ts == 12.5 and got.data_parallel_rank == 1
    assert got.events == [
        VBlockStored(h, None, list(range(8)), 4, None, "GPU"),
        VBlockRemoved([h[1]], "GPU"),
        VAllBlocksCleared(),
    ]


def test_snapshot_hash_is_sha256_of_its_parts() -> None:
    h = block_hashes([1, 2, 3, 4], 4)[0]
    want = hashlib.sha256(b"dsv4-snapshot-v1" + h + (7).to_bytes(8, "little", signed=True))
    assert snapshot_hash(h, 7) == want.digest()
    assert snapshot_hash(h) != snapshot_hash(h, 7)
    assert seq_of(seq_bytes(5)) == 5 and seq_of(REPLAY_END) == -1


def test_rank_endpoints_interleave_publish_and_replay_ports() -> None:
    assert rank_endpoints("tcp://127.0.0.1:5557", 0) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )
    assert rank_endpoints("tcp://10.0.0.3:5557", 2) == (
        "tcp://10.0.0.3:5561",
        "tcp://10.0.0.3:5562",
    )
    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "ipc:///tmp/x", "tcp://:5557", "tcp://h:0"):
        with pytest.raises(ValueError, match=r"tcp://HOST:PORT|out of range"):
            rank_endpoints(bad, 0)


class _HitRunner:
    """Samples a token per sampled request, with no history check (prefix hits skip tokens)."""

    def execute(self, out: Any) -> dict[str, RunnerResult]:
        return {s.request_id: RunnerResult([7], None, []) for s in out.scheduled if s.sample}


def _mirror(events: list[KVCacheEvent], blocks: set[bytes], snaps: set[bytes]) -> None:
    """What a subscriber keeps: the block and snapshot sets the events describe."""
    for ev in events:
        target = snaps if getattr(ev, "group_idx", None) == SNAPSHOT_GROUP else blocks
        if isinstance(ev, BlockStored):
            target.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            target.difference_update(ev.block_hashes)
        else:
            blocks.clear()
            snaps.clear()


def test_stateful_prefill_records_blocks_and_snapshots_exactly() -> None:
    kv = KVCacheManager(32, BS, 2, True, has_state=True, num_snapshot_slots=2, enable_events=True)
    assert kv.snapshot_bounded
    sched = Scheduler(SchedulerConfig(2, 6, 256, True, 0), kv)
    prompt = [*range(1, 13), 50]
    h = block_hashes(prompt, BS)
    add(sched, "a", prompt, 1)
    drive(sched, FakeRunner())
    events = kv.take_events()

    def snap(i: int) -> BlockStored:
        return BlockStored(
            [snapshot_hash(h[i])], h[i], [], BS, group_idx=SNAPSHOT_GROUP,
            kv_cache_spec_kind=SNAPSHOT_KIND,
        )  # fmt: skip

    # chunks 0-6, 6-12, 12-13: each step publishes its full blocks, then its snapshots;
    # the third snapshot (boundary 12) takes the LRU slot of boundary 4
    assert events == [
        snap(0),
        BlockStored([h[0]], None, prompt[0:4], BS),
        snap(1),
        BlockStored([h[1], h[2]], h[0], prompt[4:12], BS),
        BlockRemoved([snapshot_hash(h[0])], group_idx=SNAPSHOT_GROUP),
        snap(2),
    ]
    assert kv.take_events() == []
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_events_rebuild_the_cache_exactly_after_evictions() -> None:
    """A mixed workload on a pool far too small for it: whatever the order of stores and
    evictions, the events' sum is exactly the pool's cached hashes and published snapshots."""
    kv = KVCacheManager(12, BS, 3, True, has_state=True, num_snapshot_slots=3, enable_events=True)
    sched = Scheduler(SchedulerConfig(3, 8, 256, True, 0), kv)
    blocks: set[bytes] = set()
    snaps: set[bytes] = set()
    base = list(range(40, 52))
    for wave in range(4):
        for i in range(3):
            prompt = base[: 4 * (i + 1)] + [(wave * 7 + i * 3 + j) % 97 for j in range(5 + i)]
            add(sched, f"{wave}-{i}", prompt, 3)
        drive(sched, _HitRunner())  # type: ignore[arg-type]
        _mirror(kv.take_events(), blocks, snaps)
        assert blocks == kv.pool.cached_hashes()
        assert snaps == {snapshot_hash(b, n) for b, n in kv._boundaries}
    assert kv.pool.num_evictions > 0 and len(blocks) > 0
    assert kv.reset_prefix_cache()
    _mirror(kv.take_events(), blocks, snaps)
    assert blocks == set() == snaps


def test_events_off_record_nothing() -> None:
    kv = KVCacheManager(8, BS, 2, True, has_state=True, num_snapshot_slots=2)
    sched = Scheduler(SchedulerConfig(2, 6, 256, True, 0), kv)
    add(sched, "a", list(range(13)), 1)
    drive(sched, FakeRunner())
    assert kv.pool.events is None and kv.take_events() == []


def _recv(sub: zmq.Socket[bytes]) -> tuple[bytes, int, KVEventBatch]:
    assert sub.poll(5000), "no event batch within 5 s"
    topic, seq, payload = sub.recv_multipart()
    return topic, seq_of(seq), decode_batch(payload)


def _replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.connect(endpoint)
        sock.send_multipart((b"", seq_bytes(start)))
        out = []
        while True:
            assert sock.poll(5000), "replay did not answer"
            _, seq, payload = sock.recv_multipart()
            if seq == REPLAY_END:
                return out
            out.append((seq_of(seq), decode_batch(payload)))


def test_publisher_numbers_batches_and_replays_from_a_sequence() -> None:
    port = free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub = ZmqEventPublisher(pub_ep, replay_ep, "kv@h@m", data_parallel_rank=2, buffer_steps=3)
    try:
        sub.connect(pub_ep)
        # the slow joiner missed batch 0 (AllBlocksCleared): replay has it
        assert [(s, b.events) for s, b in _replay(replay_ep, 0)] == [(0, [AllBlocksCleared()])]
        import time

        time.sleep(0.3)  # the SUB's subscription reaches the PUB
        h = block_hashes(list(range(4)), 4)
        for i in range(4):
            pub.publish([BlockStored(h, None, list(range(4)), 4, lora_id=i)])
        # batch 0 went out from the publisher's thread: it may have reached the SUB after all
        got: list[tuple[bytes, int, KVEventBatch]] = []
        while len(got) < 4:
            r = _recv(sub)
            if r[1] > 0:
                got.append(r)
        assert [(t, s, b.data_parallel_rank) for t, s, b in got] == [
            (b"kv@h@m", s, 2) for s in (1, 2, 3, 4)
        ]
        assert [b.events[0].lora_id for _, _, b in got] == [0, 1, 2, 3]  # type: ignore[union-attr]
        # a ring of 3: from 2 on, 2..4; from 0, what is left (2..4)
        assert [s for s, _ in _replay(replay_ep, 2)] == [2, 3, 4]
        assert [s for s, _ in _replay(replay_ep, 0)] == [2, 3, 4]
        assert _replay(replay_ep, 5) == []
    finally:
        sub.close(linger=0)
        pub.close()


def test_publisher_refuses_a_taken_port() -> None:
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    first = ZmqEventPublisher(ep, None)
    try:
        with pytest.raises(RuntimeError, match="cannot bind"):
            ZmqEventPublisher(ep, None)
    finally:
        first.close()
