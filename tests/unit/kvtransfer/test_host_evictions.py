"""The host tier's numbered eviction log (what the engine beside the sidecar announces as
``BlockRemoved`` medium CPU), its route and the engine's watcher on a real sidecar, and the
engine's side: an announced entry's eviction becomes that event; one evicted before its
offer's result came back is never announced. Exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_common.kv_events import (
    MEDIUM_DISK,
    MEDIUM_HOST,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    snapshot_hash,
)
from dsv4_kvtransfer.buffers import BufferSpec
from dsv4_kvtransfer.client import SidecarClient, SidecarError
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.control import ControlServer
from dsv4_kvtransfer.host_evictions import EvictionLog, Evictions
from dsv4_kvtransfer.pd_protocol import prefix_transfer_id
from dsv4_kvtransfer.sidecar import Sidecar
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.kv_connector.host_evictions import HostEvictionWatcher
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams


def test_the_log_numbers_evictions_and_says_when_some_are_lost() -> None:
    log = EvictionLog(capacity=3)
    assert log.since(0) == Evictions(0, [], False)
    log.add(["a", "b"])
    assert log.since(0) == Evictions(2, ["a", "b"], False, [("a", None), ("b", None)])
    assert log.since(1) == Evictions(2, ["b"], False, [("b", None)])
    assert log.since(2) == Evictions(2, [], False)
    assert log.since(1 << 62) == Evictions(2, [], False)  # past the end: just the number
    log.add(["c", "d"])  # "a" falls out
    assert log.since(0) == Evictions(4, ["b", "c", "d"], True, [(k, None) for k in "bcd"])
    assert log.since(1).transfer_ids == ["b", "c", "d"] and not log.since(1).lost
    assert log.since(3).to_dict() == {
        "next": 4,
        "transfer_ids": ["d"],
        "lost": False,
        "moves": [["d", None]],
    }


def test_moves_between_tiers_are_numbered_in_order_with_the_evictions() -> None:
    log = EvictionLog()
    log.add_moves(["a"], MEDIUM_DISK)  # spilled
    log.add(["b"])  # gone
    log.add_moves(["a"], MEDIUM_HOST)  # read back for a pull
    assert log.since(0) == Evictions(
        3, ["b"], False, [("a", MEDIUM_DISK), ("b", None), ("a", MEDIUM_HOST)]
    )


BS = 4
MB = 1 << 20


def _offered(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[str, bytes]:
    """``rid`` finished ``tokens`` (all computed) and its offer went in: its transfer id and
    host key (what ``begin_offer`` keys it by, set here without running a model)."""
    r = Request(EngineCoreRequest(rid, tokens, SamplingParams()), 0)
    h = r.update_block_hashes(BS)
    key = (h[-1], -1)
    kv._offer_keys[rid] = key
    digest = snapshot_hash(*key)
    return prefix_transfer_id(digest.hex()), digest


def test_the_engine_announces_an_announced_entrys_eviction() -> None:
    kv = KVCacheManager(
        16, BS, 2, enable_caching=True, has_state=True, num_snapshot_slots=2, enable_events=True
    )
    tid, key = _offered(kv, "a", list(range(1, 9)))
    r = Request(EngineCoreRequest("a", list(range(1, 9)), SamplingParams()), 0)
    kv.offer_stored(r)
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored) and stored.block_hashes == [key]
    assert stored.medium == MEDIUM_HOST
    kv.host_evicted(["f" * 24, tid])  # another id (not ours) is ignored
    (removed,) = kv.take_events()
    assert removed == BlockRemoved([key], medium=MEDIUM_HOST, group_idx=1)
    kv.host_evicted([tid])  # once only
    assert kv.take_events() == []


def test_the_engine_announces_an_entrys_moves_to_disk_and_back_and_its_drop() -> None:
    kv = KVCacheManager(
        16, BS, 2, enable_caching=True, has_state=True, num_snapshot_slots=2, enable_events=True
    )
    tid, key = _offered(kv, "a", list(range(1, 9)))
    kv.offer_stored(Request(EngineCoreRequest("a", list(range(1, 9)), SamplingParams()), 0))
    kv.take_events()
    kv.host_tier_moved([(tid, MEDIUM_DISK), ("f" * 24, MEDIUM_DISK)])  # not ours: ignored
    removed, stored = kv.take_events()
    assert removed == BlockRemoved([key], medium=MEDIUM_HOST, group_idx=1)
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM_DISK
    assert stored.block_hashes == [key]
    kv.host_tier_moved([(tid, MEDIUM_DISK)])  # no change: nothing
    assert kv.take_events() == []
    kv.host_tier_moved([(tid, MEDIUM_HOST), (tid, MEDIUM_DISK), (tid, None)])
    events = kv.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [
        ("BlockRemoved", MEDIUM_DISK),
        ("BlockStored", MEDIUM_HOST),
        ("BlockRemoved", MEDIUM_HOST),
        ("BlockStored", MEDIUM_DISK),
        ("BlockRemoved", MEDIUM_DISK),  # dropped from disk: gone from the medium it was in
    ]
    kv.host_tier_moved([(tid, MEDIUM_HOST)])  # gone already
    assert kv.take_events() == []


def test_the_gateways_index_keeps_a_prefix_moved_to_disk_pullable() -> None:
    from dsv4_serving.gateway.kv_index import RankCache

    key, parent = b"k" * 32, b"p" * 32
    stored = BlockStored([key], parent, [], BS, None, medium=MEDIUM_HOST, group_idx=1)
    rc = RankCache()
    rc.apply(0, KVEventBatch(0.0, [stored]))
    to_disk = [
        BlockRemoved([key], medium=MEDIUM_HOST, group_idx=1),
        BlockStored([key], parent, [], BS, None, medium=MEDIUM_DISK, group_idx=1),
    ]
    rc.apply(1, KVEventBatch(0.0, to_disk))
    assert rc.host == {key} and rc.snapshots == set()
    rc.apply(2, KVEventBatch(0.0, [BlockRemoved([key], medium=MEDIUM_DISK, group_idx=1)]))
    assert rc.host == set()


def test_an_entry_evicted_before_its_offer_came_back_is_never_announced() -> None:
    kv = KVCacheManager(
        16, BS, 2, enable_caching=True, has_state=True, num_snapshot_slots=2, enable_events=True
    )
    tid, _ = _offered(kv, "a", list(range(1, 9)))
    kv.host_evicted([tid])
    assert kv.take_events() == []
    kv.offer_stored(Request(EngineCoreRequest("a", list(range(1, 9)), SamplingParams()), 0))
    assert kv.take_events() == []


def test_a_sidecar_reports_its_evictions_to_the_engines_watcher(tmp_path: Path) -> None:
    """A sidecar in this process (its control API on a real socket) with a host tier of 3
    entries' room: each further offer evicts the oldest; ``/v1/host-tier/evictions`` numbers
    them and the engine's watcher hands over those after its start, each once."""
    cfg = SidecarConfig(
        token=b"a-token-for-the-host-eviction-unit-test",
        host="127.0.0.1",
        port=0,
        control_port=0,
        staging_bytes=16 * MB,
        kv_host_bytes=3 * MB + 3 * 64 * 1024,
        shm_name="he-a",
        shm_dir=str(tmp_path),
        sidecar_id="he-a",
        copy_threads=1,
        log_level="warning",
    )
    sc = Sidecar(cfg)
    sc.start()
    control = ControlServer(sc, "127.0.0.1", 0)
    control.start()
    client = SidecarClient(f"http://127.0.0.1:{control.port}")
    watcher = HostEvictionWatcher(client, interval_s=3600)  # polled by hand here
    try:

        def offer(k: int) -> str:
            key = f"{k:02x}" + "ab" * 31  # the transfer id is its first 24 digits
            res = client.reserve_export(
                f"r{k}", [BufferSpec("kv", "uint8", (MB,))], num_tokens=16, prefix_key=key
            )
            client.commit_export(res.transfer_id)
            return prefix_transfer_id(key)

        ids = [offer(k) for k in range(4)]  # the 4th evicts the 1st
        assert client.host_evictions(0) == (1, [ids[0]], False)
        watcher.poll()  # its start: what was evicted before is not its engine's
        assert watcher.take() == []
        ids += [offer(k) for k in range(4, 6)]
        watcher.poll()
        assert watcher.take() == [(i, None) for i in ids[1:3]]
        watcher.poll()
        assert watcher.take() == []
        with pytest.raises(SidecarError, match="since"):
            client.request("GET", "/v1/host-tier/evictions?since=x")
    finally:
        watcher.close()
        client.close()
        control.stop()
        sc.stop()
