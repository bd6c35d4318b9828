"""The host tier's numbered eviction log (what the engine beside the sidecar announces as
``BlockRemoved`` medium CPU), and the engine's side: an announced entry's eviction becomes
that event; one evicted before its offer's result came back is never announced. Exact."""

from __future__ import annotations

from dsv4_common.kv_events import MEDIUM_HOST, BlockRemoved, BlockStored, snapshot_hash
from dsv4_kvtransfer.host_evictions import EvictionLog, Evictions
from dsv4_kvtransfer.pd_protocol import prefix_transfer_id
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams


def test_the_log_numbers_evictions_and_says_when_some_are_lost() -> None:
    log = EvictionLog(capacity=3)
    assert log.since(0) == Evictions(0, [], False)
    log.add(["a", "b"])
    assert log.since(0) == Evictions(2, ["a", "b"], False)
    assert log.since(1) == Evictions(2, ["b"], False)
    assert log.since(2) == Evictions(2, [], False)
    assert log.since(1 << 62) == Evictions(2, [], False)  # past the end: just the number
    log.add(["c", "d"])  # "a" falls out
    assert log.since(0) == Evictions(4, ["b", "c", "d"], True)
    assert log.since(1) == Evictions(4, ["b", "c", "d"], False)
    assert log.since(3).to_dict() == {"next": 4, "transfer_ids": ["d"], "lost": False}


BS = 4


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


def test_an_entry_evicted_before_its_offer_came_back_is_never_announced() -> None:
    kv = KVCacheManager(
        16, BS, 2, enable_caching=True, has_state=True, num_snapshot_slots=2, enable_events=True
    )
    tid, _ = _offered(kv, "a", list(range(1, 9)))
    kv.host_evicted([tid])
    assert kv.take_events() == []
    kv.offer_stored(Request(EngineCoreRequest("a", list(range(1, 9)), SamplingParams()), 0))
    assert kv.take_events() == []
