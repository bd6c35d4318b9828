"""The scheduler's side of prefix pulls and offers, pure Python: a pull parks the request with
its local hit shared and loads only the blocks after it, then the rest of the prompt is
computed; a refused or failed pull is computed instead and counted; a finished request offers
its deepest snapshotted prefix without holding its answer back."""

from __future__ import annotations

from dsv4_common.kv_events import snapshot_hash
from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, PrefixPullParams
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.scheduler import (
    RunnerResult,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from dsv4_serving.engine.kv_connector.metadata import KVConnectorOutput, KVTransferFailure
from dsv4_serving.engine.kv_connector.scheduler_side import SidecarConnectorScheduler
from dsv4_serving.engine.request import EngineCoreRequest, Request, RequestStatus
from dsv4_serving.engine.sample.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(1, 15))  # 14 tokens: 3 full blocks and 2


def make(offers: bool = False) -> tuple[Scheduler, KVCacheManager, SidecarConnectorScheduler]:
    kv = KVCacheManager(32, BS, 4, enable_caching=True, has_state=True, num_snapshot_slots=4)
    conn = SidecarConnectorScheduler()
    conn.offers_prefixes = offers
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    return Scheduler(cfg, kv, conn), kv, conn


def key(tokens: list[int], num_blocks: int) -> str:
    r = Request(EngineCoreRequest("k", tokens, SamplingParams()), 0)
    h = r.update_block_hashes(BS)
    return snapshot_hash(h[num_blocks - 1]).hex()


def req(rid: str, tokens: list[int], params: object = None, max_tokens: int = 2) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(EngineCoreRequest(rid, tokens, sp, kv_transfer_params=params), 0)  # type: ignore[arg-type]


def pull(n: int, tokens: list[int] = PROMPT) -> PrefixPullParams:
    return PrefixPullParams("10.0.0.7", 14579, n, key(tokens, n // BS))


def run(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    s.update_from_output(out, {x.request_id: RunnerResult([token]) for x in out.scheduled})


def test_a_prefix_pull_loads_its_blocks_and_the_rest_is_computed_here() -> None:
    s, kv, conn = make()
    r = req("r", PROMPT, pull(8))
    s.add_request(r)
    assert s.schedule().scheduled == [] and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    (load,) = conn.build_connector_meta().loads
    assert (load.params, load.block_ids, load.first_block) == (None, kv.block_ids("r")[:2], 0)
    assert (load.num_tokens, load.token_ids, load.state_slot) == (8, PROMPT[:8], kv.req_slot["r"])
    assert load.prefix == pull(8)
    s.update_from_connector(KVConnectorOutput(loaded=["r"]))
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.context_len, x.token_ids, x.sample) == (8, PROMPT[8:], True)
    assert out.state_copies == [(kv.req_slot["r"], 4)]  # the pulled boundary: snapshotted here
    assert r.kv_transfer_params is None and r.num_cached_tokens == 8
    assert (conn.stats.prefix_pulls_ok, conn.stats.prefix_pulled_tokens) == (1, 8)
    assert conn.stats.prefix_recomputed_tokens == 0


def test_the_local_hit_is_shared_and_only_the_blocks_after_it_are_pulled() -> None:
    s, kv, conn = make()
    s.add_request(req("a", PROMPT[:5], max_tokens=1))
    run(s, s.schedule())  # blocks 0 published with the snapshot at 4
    assert not s.has_unfinished_requests()
    s.add_request(req("r", PROMPT, PrefillRequestParams(pull(12))))
    out = s.schedule()
    assert out.scheduled == [] and out.state_copies == []  # no restore: the pulled state wins
    (load,) = conn.build_connector_meta().loads
    assert (load.first_block, load.block_ids) == (1, kv.block_ids("r")[1:3])
    s.update_from_connector(KVConnectorOutput(loaded=["r"]))
    (x,) = s.schedule().scheduled
    assert (x.context_len, x.token_ids) == (12, PROMPT[12:])
    assert s.requests["r"].kv_transfer_params == PrefillRequestParams()  # still a PD prefill
    assert conn.stats.prefix_pulled_tokens == 8  # blocks 1 and 2: block 0 was local


def test_a_pulled_request_counts_its_prompt_and_its_local_and_pulled_hits() -> None:
    s, _, _ = make()
    s.add_request(req("a", PROMPT[:5], max_tokens=1))
    run(s, s.schedule())  # 5 queried, nothing hit; block 0 and its snapshot published
    assert (s.stats.prefix_queries, s.stats.prefix_hits) == (5, 0)
    s.add_request(req("r", PROMPT, pull(12)))
    s.schedule()
    assert (s.stats.prefix_queries, s.stats.prefix_hits) == (5, 0)  # parked: not yet
    s.update_from_connector(KVConnectorOutput(loaded=["r"]))
    # 14 queried, 4 local and 8 pulled tokens hit: 2 computed here
    assert (s.stats.prefix_queries, s.stats.prefix_hits) == (19, 12)
    s.schedule()
    assert (s.stats.prefix_queries, s.stats.prefix_hits) == (19, 12)  # counted once


def test_a_failed_pull_counts_only_when_it_is_admitted_again() -> None:
    s, _, conn = make()
    s.add_request(req("r", PROMPT, pull(8)))
    s.schedule()
    conn.build_connector_meta()
    s.update_from_connector(KVConnectorOutput(failed={"r": KVTransferFailure("connection", "x")}))
    assert (s.stats.prefix_queries, s.stats.prefix_hits) == (0, 0)
    s.schedule()
    assert (s.stats.prefix_queries, s.stats.prefix_hits) == (14, 0)


def test_a_pull_of_another_prompt_or_covered_locally_is_dropped_and_counted() -> None:
    s, _, conn = make()
    other = [99, *PROMPT[1:]]
    s.add_request(req("r", PROMPT, pull(8, other), max_tokens=1))
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.context_len, len(x.token_ids)) == (0, 14) and not conn.build_connector_meta().loads
    assert conn.stats.prefix_recomputed_tokens == 8
    run(s, out)
    assert not s.has_unfinished_requests()
    s.add_request(req("s", PROMPT, pull(8)))  # blocks 0-2 and their snapshots are local now
    (x,) = s.schedule().scheduled
    assert x.context_len == 12 and not conn.build_connector_meta().loads
    assert conn.stats.prefix_recomputed_tokens == 16
    s.add_request(req("t", PROMPT[:8], pull(8)))  # leaves no token to compute
    assert not conn.build_connector_meta().loads


def test_a_failed_pull_is_computed_whatever_the_failure_policy() -> None:
    for failure in (KVTransferFailure("connection", "x"), KVTransferFailure("incompatible", "y")):
        s, kv, conn = make()
        conn.failure_policy = "fail"
        free = kv.num_free_blocks
        s.add_request(req("r", PROMPT, pull(8)))
        s.schedule()
        conn.build_connector_meta()
        s.update_from_connector(KVConnectorOutput(failed={"r": failure}))
        assert kv.num_free_blocks == free
        (x,) = s.schedule().scheduled
        assert (x.context_len, len(x.token_ids)) == (
            0,
            14,
        ) and not conn.build_connector_meta().loads
        assert conn.stats.prefix_recomputed_tokens == 8 and conn.stats.recomputes == 0


def test_a_finished_request_offers_its_deepest_snapshot_without_holding_its_answer() -> None:
    s, kv, conn = make(offers=True)
    s.add_request(req("a", PROMPT[:10], max_tokens=3))
    outs = []
    while s.requests:
        out = s.schedule()
        outs.append(
            s.update_from_output(out, {x.request_id: RunnerResult([7]) for x in out.scheduled})
        )
    s.hold_saving_outputs(outs[-1])
    assert [o.finish_reason for o in outs[-1]] == ["length"]  # not held back
    (save,) = conn.take_saves()
    seq = [*PROMPT[:10], 7, 7, 7]  # 12 computed: the boundary at 12 has its snapshot
    assert (save.prefix_key, save.num_tokens, save.prompt_token_ids) == (key(seq, 3), 12, seq[:12])
    assert conn.stats.prefix_offers == 1
    held = kv.block_ids("a")
    assert save.block_ids == held[:3] and s.has_unfinished_requests()
    # the snapshot is out of the LRU while it is copied: a lookup cannot hit (nor evict) it
    assert (kv.prefix_key(s._saving["a"], 3), save.state_slot) == (save.prefix_key, save.state_slot)
    assert save.state_slot not in kv._boundaries.values()
    s.saves_done({"a": KVTransferFailure("export_failed", "duplicate")}, [])
    assert not s.has_unfinished_requests() and save.state_slot in kv._boundaries.values()
    s.add_request(req("b", [*seq, 5]))
    assert s.schedule().scheduled[0].context_len == 12  # the snapshot is back in the LRU
