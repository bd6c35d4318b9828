"""Async scheduling under DP 2 (EP 2, the ranks as processes behind the front end): each rank's
core agrees with the other on step N+1 over the lockstep's own group while its step thread's
forward all-gathers over the DP group, and the MTP chain runs on every rank when any rank
drafts. Greedy tokens equal the single-process engine's (where the parallel MoE's other
summation order meets a near tie, the dist tier's rule applies), with chunked prefill,
prefix hits, MTP drafts, and a wave pinned to rank 1 while rank 0 steps dummy batches."""

from __future__ import annotations

from dataclasses import replace

from dsv4_serving.engine.config import EngineConfig
from tests.dist.engine_cases import near_ties, reference, serve_through_front_end

from .common import workload

SHARED = 40


def test_dp2_async_gives_single_process_tokens() -> None:
    base = EngineConfig(
        model="dsv4-tiny",
        max_model_len=384,
        num_kv_blocks=200,
        max_num_seqs=8,
        max_num_batched_tokens=61,
        num_speculative_tokens=2,
        threads_per_rank=1,
    )
    work = workload(8, 5, SHARED)
    ref = reference(base, work)
    cfg = replace(base, data_parallel_size=2, expert_parallel_size=2, async_scheduling="on")
    assert cfg.async_unsupported() is None
    got = serve_through_front_end(cfg, work, [None, 1])
    ties = near_ties(got.tokens, ref)
    print(f"dp 2 async: {len(ties)} near-tie differences {ties}")
    assert got.stats.spec_draft_tokens > 0
    first, second = got.wave_rank_stats
    assert all(r.prefix_queries > 0 for r in first)  # the router used both ranks
    assert second[0].prefix_queries == first[0].prefix_queries  # rank 0 idled in wave 2
    assert second[1].prefix_hits > first[1].prefix_hits
    assert all(r.num_free_blocks == r.num_total_blocks for r in second)
