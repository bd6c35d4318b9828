"""The engine with its ranks as processes serves the single-process engine's greedy tokens,
with chunked prefill, prefix caching and MTP drafts on: TP 2, TP 2 + EP 2, DP 2 (EP 2) and
TP 2 x DP 2 (EP 4, 4 processes). With DP, a wave pinned by the header lands on its rank while
the other rank idles (dummy batches) and nothing hangs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dsv4_serving.engine.config import EngineConfig
from tests.engine.common import pass_through_checkpoint, workload

from .engine_cases import Reference, near_ties, reference, serve_through_front_end

pytestmark = pytest.mark.dist

SHARED = 40  # tokens of common prefix: the second wave hits the prefix cache
CASES = [
    # (model, tp, dp, ep, MTP drafts)
    ("dsv4-tiny", 2, 1, 1, 2),
    ("dsv4-tiny", 2, 1, 2, 1),
    ("dsv3-small", 2, 1, 1, 1),
    ("dsv3-small", 2, 1, 2, 2),
    ("dsv4-tiny", 1, 2, 2, 2),
    ("dsv3-small", 1, 2, 2, 1),
    ("dsv4-tiny", 2, 2, 4, 1),
    ("dsv3-small", 2, 2, 4, 2),
]


def _base(model: str, mtp: int) -> EngineConfig:
    return EngineConfig(
        model=model,
        max_model_len=384,
        num_kv_blocks=200,
        max_num_seqs=8,
        max_num_batched_tokens=61,  # chunked prefill: long prompts take several steps
        num_speculative_tokens=mtp,
        threads_per_rank=1,
    )


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    """One process, each request alone (no drafts there: the same for every MTP setting)."""
    return {m: reference(_base(m, 0), workload(8, 5, SHARED)) for m in ("dsv4-tiny", "dsv3-small")}


@pytest.mark.parametrize(
    ("model", "tp", "dp", "ep", "mtp"),
    CASES,
    ids=[f"{m}-tp{t}-dp{d}-ep{e}-mtp{k}" for m, t, d, e, k in CASES],
)
def test_parallel_engine_gives_single_process_tokens(
    references: dict[str, Reference], model: str, tp: int, dp: int, ep: int, mtp: int
) -> None:
    base = _base(model, mtp)
    work = workload(8, 5, SHARED)
    ref = references[model]
    cfg = replace(base, tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel_size=ep)
    # DP: the engine routes the first wave; the second is pinned to rank 1 (rank 0 idles)
    pins: list[int | None] = [None, 1] if dp > 1 else [None, None]
    got = serve_through_front_end(cfg, work, pins)
    ties = near_ties(got.tokens, ref)
    print(f"{model} tp {tp} dp {dp} ep {ep}: {len(ties)} near-tie differences {ties}")
    assert got.stats.spec_draft_tokens > 0
    if dp == 1:
        assert got.stats.prefix_hits >= SHARED // 16 * 16  # wave 2 reused wave 1's blocks
        return
    first, second = got.wave_rank_stats
    assert all(r.prefix_queries > 0 for r in first)  # the router used both ranks
    assert second[0].prefix_queries == first[0].prefix_queries  # nothing pinned to 0 ran there
    wave2 = sum(len(p) for p, _ in work[4:])
    assert second[1].prefix_queries - first[1].prefix_queries >= wave2
    assert second[1].prefix_hits > first[1].prefix_hits  # pinned next to its prefix


@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (1, 2)], ids=["tp2", "dp2-ep2"])
def test_right_drafts_are_accepted_across_ranks(tmp_path: Path, tp: int, dp: int) -> None:
    """Drafts of the pass-through checkpoint are right: accepted under TP (rank 0 tells the
    followers what it accepted) and DP (every rank chains its MTP calls) as in one process."""
    pass_through_checkpoint(tmp_path)
    base = replace(_base(str(tmp_path), 3), max_num_batched_tokens=2048)
    work = workload(8, 3)
    ref = reference(base, work)
    cfg = replace(
        base, tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel_size=tp * dp
    )
    got = serve_through_front_end(cfg, work, [None])
    ties = near_ties(got.tokens, ref)
    print(f"pass-through tp {tp} dp {dp}: {len(ties)} near-tie differences {ties}")
    assert got.stats.spec_accepted_tokens / got.stats.spec_draft_tokens > 0.9
