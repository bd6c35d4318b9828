"""The precise prefix index and the routing scorers: pure logic, exact numbers; the index
agrees with the engine's own prefix lookup on the same events."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    snapshot_removed,
    snapshot_stored,
)
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, Scheduler, SchedulerConfig
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.gateway.instances import Instance
from dsv4_serving.gateway.kv_index import Live, RankCache, Replay, on_live, on_replay
from dsv4_serving.gateway.policies import Choice, RouteRequest, make_policy
from dsv4_serving.gateway.scorers import DEFAULT_WEIGHTS, cost, parse_weights

BS = 4


def _batch(*events: KVCacheEvent, bounded: bool = True) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events), snapshot_bounded=bounded)  # type: ignore[arg-type]


def test_live_sequence_decisions() -> None:
    assert on_live(0, None) is Live.APPLY  # a publisher's first batch: the whole story
    assert on_live(5, None) is Live.RESYNC  # joined late: replay what came before
    assert on_live(5, 5) is Live.APPLY
    assert on_live(7, 5) is Live.RESYNC  # a gap
    assert on_live(0, 9) is Live.APPLY  # a restart, its AllBlocksCleared seen
    assert on_live(3, 9) is Live.RESYNC  # a restart whose batch 0 was missed
    assert on_live(3, 9, replayed_from=2) is Live.SKIP  # came in the replay already
    assert on_live(1, 9, replayed_from=2) is Live.RESYNC


def test_replay_decisions() -> None:
    assert on_replay(0, 17) is Replay.REBUILD
    assert on_replay(0, None) is Replay.REBUILD
    assert on_replay(12, 17) is Replay.CONTINUE
    assert on_replay(17, 17) is Replay.CONTINUE
    assert on_replay(18, 17) is Replay.LOSSY
    assert on_replay(4, None) is Replay.LOSSY


def test_apply_keeps_blocks_and_snapshots_apart() -> None:
    h = block_hashes(list(range(12)), BS)
    c = RankCache()
    c.apply(0, _batch(AllBlocksCleared()))
    c.apply(1, _batch(BlockStored(h, None, list(range(12)), BS), snapshot_stored(h[1], -1, BS)))
    assert c.blocks == set(h) and len(c.snapshots) == 1 and c.block_size == BS
    c.apply(2, _batch(BlockRemoved([h[2]]), snapshot_removed(h[1], -1)))
    assert c.blocks == {h[0], h[1]} and c.snapshots == set() and c.expected == 3
    c.apply(3, _batch(AllBlocksCleared()))
    assert c.blocks == set() and c.batches == 4


def test_usable_tokens_stop_at_a_gap_and_at_the_deepest_snapshot() -> None:
    ids = list(range(17))  # 4 full blocks; at most 16 tokens cached (one left to compute)
    h = block_hashes(ids, BS)
    c = RankCache()
    c.apply(0, _batch(BlockStored(h, None, ids[:16], BS), bounded=False))
    assert c.usable_tokens(h, ids, BS) == 16
    assert c.usable_tokens(h, ids[:16], BS) == 12  # a 16-token prompt: 15 at most -> 3 blocks
    assert c.usable_tokens(h, ids, 8) == 0  # another block size: nothing is comparable
    c.apply(1, _batch(snapshot_stored(h[1], -1, BS)))  # bounded now: the snapshot at 8
    assert c.usable_tokens(h, ids, BS) == 8
    c.apply(2, _batch(snapshot_stored(h[2], ids[12], BS)))  # MTP key: with the next token
    assert c.usable_tokens(h, ids, BS) == 12
    assert c.usable_tokens(h, [*ids[:12], 99, *ids[13:]], BS) == 8  # another next token
    c.apply(3, _batch(BlockRemoved([h[1]])))  # a missing middle block cuts the run
    assert c.usable_tokens(h, ids, BS) == 0


def test_resync_rebuilds_continues_or_starts_over() -> None:
    h = block_hashes(list(range(16)), BS)
    stored = [BlockStored([x], None, [], BS) for x in h]
    c = RankCache()
    c.apply(0, _batch(AllBlocksCleared()))
    c.apply(1, _batch(stored[0]))
    # missed batch 2 (stores h[1]); the ring holds 0..3
    ring = [(0, _batch(AllBlocksCleared())), (1, _batch(stored[0]))]
    ring += [(2, _batch(stored[1])), (3, _batch(stored[2]))]
    assert c.resync(ring) is Replay.REBUILD
    assert c.blocks == set(h[:3]) and (c.expected, c.replayed_from) == (4, 0)
    assert c.resync([*ring[2:], (4, _batch(stored[3]))]) is Replay.CONTINUE
    assert c.blocks == set(h) and c.expected == 5 and c.replayed_from == 4
    c.blocks.add(b"stale")
    assert c.resync([(9, _batch(BlockRemoved([h[0]])))]) is Replay.LOSSY
    assert c.blocks == set() and c.lossy_resyncs == 1 and c.resyncs == 3
    assert c.resync([]) is None


class _Runner:
    def execute(self, out: Any) -> dict[str, RunnerResult]:
        return {s.request_id: RunnerResult([7], None, []) for s in out.scheduled if s.sample}


@pytest.mark.parametrize("mtp", [False, True])
def test_index_agrees_with_the_engines_own_lookup(mtp: bool) -> None:
    """The engine's cache (stateful, snapshots LRU, a pool small enough to evict), its events
    mirrored into a RankCache: for every probe prompt, the usable prefix the gateway computes
    is exactly the one the engine would hit."""
    kv = KVCacheManager(14, BS, 3, True, True, 3, key_next_token=mtp, enable_events=True)
    sched = Scheduler(SchedulerConfig(3, 8, 256, True, 0), kv)
    cache = RankCache()
    seq = 0
    base = list(range(40, 60))
    probes = [[*base[:n], n] for n in (3, 5, 9, 13, 17, 20)] + [[1, *base]]
    matched = 0
    for wave in range(5):
        for i in range(3):
            prompt = base[: 4 * (i + wave % 2 + 1)] + [
                (wave * 5 + i + j) % 97 for j in range(3 + i)
            ]
            sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            sched.add_request(Request(EngineCoreRequest(f"{wave}-{i}", prompt, sp), None))
        while sched.has_unfinished_requests():
            out = sched.schedule()
            sched.update_from_output(out, _Runner().execute(out))  # type: ignore[arg-type]
            cache.apply(seq, _batch(*kv.take_events(), bounded=kv.snapshot_bounded))
            seq += 1
        for p in probes:
            want = kv.get_computed_blocks(Request(EngineCoreRequest("p", p, sp), None)).num_tokens
            assert cache.usable_tokens(block_hashes(p, BS), p, BS) == want, (wave, p)
            matched += want > 0
    assert kv.pool.num_evictions > 0 and matched > 0


def _inst(url: str, events: bool) -> Instance:
    inst = Instance(url=url, role="both")
    if events:
        inst.kv_ranks = [RankCache()]
    return inst


def test_weights_parse_and_refuse_unknown_scorers() -> None:
    assert parse_weights(DEFAULT_WEIGHTS) == {
        "load": 1.0,
        "precise_prefix": 1.0,
        "estimated_prefix": 1.0,
        "prefix_pull": 1.0,
    }
    assert parse_weights("load=2, precise_prefix=0.5") == {"load": 2.0, "precise_prefix": 0.5}
    for bad, msg in (
        ("fastest=1", "unknown scorer 'fastest'"),
        ("load=x", "not a number"),
        ("load=-1", ">= 0"),
        ("", "names no scorer"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_weights(bad)


def test_scorers_cost_exactly() -> None:
    ids = list(range(33))
    h = block_hashes(ids, BS)
    precise, estimated = _inst("http://p:1", True), _inst("http://e:1", False)
    assert precise.kv_ranks is not None
    precise.kv_ranks[0].apply(0, _batch(BlockStored(h[:6], None, ids[:24], BS), bounded=False))
    estimated.prefix.add(h[:3])
    precise.begin(0, 100)
    estimated.ranks[0].waiting = 1
    req = RouteRequest(33, h, BS, token_ids=ids)
    w = parse_weights(DEFAULT_WEIGHTS)
    assert cost(precise, 0, req, w) == 100 + 33 - 24
    assert cost(estimated, 0, req, w) == 33 + 256 - 12
    # the estimate never counts for an instance with events, and vice versa
    precise.prefix.add(h)
    assert cost(precise, 0, req, w) == 100 + 33 - 24
    assert cost(precise, 0, req, {"load": 1.0}) == 133
    assert cost(precise, 0, req, {"load": 1.0, "precise_prefix": 3.0}) == 133 - 72


def test_dplb_routes_to_the_precise_holder_and_reports_its_prediction() -> None:
    ids = list(range(65))
    h = block_hashes(ids, BS)
    a, b = _inst("http://a:1", True), _inst("http://b:1", True)
    assert b.kv_ranks is not None
    b.kv_ranks[0].apply(0, _batch(BlockStored(h, None, ids[:64], BS), bounded=False))
    b.begin(0, 40)  # busier, but holds 64 of the prompt's 65 tokens
    policy = make_policy("dplb")
    seen: list[Choice] = []
    policy.on_choice = lambda req, choice: seen.append(choice)  # type: ignore[attr-defined]
    choice = policy.choose([a, b], RouteRequest(65, h, BS, token_ids=ids))
    assert choice == Choice(b, 0, 64) and seen == [choice]
    # weighted to ignore the prefix, load alone decides
    policy = make_policy("dplb", {"load": 1.0})
    assert policy.choose([a, b], RouteRequest(65, h, BS, token_ids=ids)) == Choice(a, 0, 0)


def test_predicted_and_actual_cached_tokens_are_counted_per_instance() -> None:
    from dsv4_serving.gateway.app import Gateway
    from dsv4_serving.gateway.config import GatewayConfig

    gw = Gateway(GatewayConfig(both_urls=["http://x:1"]))
    inst = _inst("http://x:1", True)
    req = RouteRequest(100, (), BS)
    gw._predicted(req, Choice(inst, 0, 32))
    gw._observe_cached(req, {"usage": {"prompt_tokens_details": {"cached_tokens": 48}}})
    gw._observe_cached(req, {"usage": {}})  # no prediction left, nothing reported: ignored
    samples = {
        (s.name, s.labels.get("instance")): s.value
        for f in gw.metrics.registry.collect()
        for s in f.samples
        if "cached" in s.name
    }
    assert samples[("dsv4_gateway_predicted_cached_tokens_total", "http://x:1")] == 32
    assert samples[("dsv4_gateway_actual_cached_tokens_total", "http://x:1")] == 48
    assert samples[("dsv4_gateway_cached_tokens_error_sum", None)] == 16
    assert samples[("dsv4_gateway_cached_tokens_error_count", None)] == 1
    assert gw._predictions == {}
