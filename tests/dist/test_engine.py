"""The engine with its ranks as processes (TP 2, TP 2 + EP 2) serves the single-process
engine's greedy tokens, with chunked prefill, prefix caching and MTP drafts on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsv4_serving.engine.config import EngineConfig
from tests.engine.common import workload

from .engine_cases import near_ties, reference, serve_through_front_end

pytestmark = pytest.mark.dist

SHARED = 40  # tokens of common prefix: the second wave hits the prefix cache


@pytest.mark.parametrize(
    ("model", "tp", "ep", "mtp"),
    [
        ("dsv4-tiny", 2, 1, 2),
        ("dsv4-tiny", 2, 2, 1),
        ("dsv3-small", 2, 1, 1),
        ("dsv3-small", 2, 2, 2),
    ],
    ids=["dsv4-tp2-mtp2", "dsv4-tp2-ep2-mtp1", "dsv3-tp2-mtp1", "dsv3-tp2-ep2-mtp2"],
)
def test_tensor_and_expert_parallel_engine_gives_single_process_tokens(
    model: str, tp: int, ep: int, mtp: int
) -> None:
    base = EngineConfig(
        model=model,
        max_model_len=384,
        num_kv_blocks=200,
        max_num_seqs=8,
        max_num_batched_tokens=61,  # chunked prefill: long prompts take several steps
        num_speculative_tokens=mtp,
        threads_per_rank=1,
    )
    work = workload(8, 5, SHARED)
    ref = reference(base, work)
    cfg = replace(base, tensor_parallel_size=tp, expert_parallel_size=ep)
    got, stats = serve_through_front_end(cfg, work, waves=2)
    ties = near_ties(got, ref)
    print(f"{model} tp {tp} ep {ep}: {len(ties)} near-tie differences {ties}")
    assert stats.prefix_hits >= SHARED // 16 * 16  # the second wave reused the first's blocks
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
