"""EPLB live in the engine: DP 2 x EP 2 ranks as processes, exact MoE combine, a workload
whose routing is skewed (prompts of a few token ids: the hash layer and the biased router send
most tokens to a few experts). With EPLB on (2 redundant slots, a re-placement every few steps,
and rank 0 idling on dummy batches for the pinned second wave) the greedy tokens are exactly
those of EPLB off, and /metrics shows re-placements that evened the load."""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import replace

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.async_llm import AsyncLLM
from dsv4_serving.engine.engine.tokenizer import load_tokenizer
from dsv4_serving.entrypoints.metrics import EngineMetrics

from .engine_cases import Served, Work, _generate

pytestmark = pytest.mark.dist

BASE = EngineConfig(
    model="dsv4-tiny",
    max_model_len=256,
    num_kv_blocks=120,
    max_num_seqs=4,
    max_num_batched_tokens=48,  # chunked prefill: several steps per wave
    num_speculative_tokens=1,  # the MTP layer's experts are balanced too
    data_parallel_size=2,
    expert_parallel_size=2,
    exact_moe=True,
    threads_per_rank=1,
)


def skewed(n: int, seed: int) -> Work:
    rng = random.Random(seed)
    hot = [5, 9, 5, 5, 17]
    return [([rng.choice(hot) for _ in range(rng.randrange(20, 90))], 6 + i % 5) for i in range(n)]


def serve(config: EngineConfig, work: Work, pins: list[int | None]) -> tuple[Served, str]:
    metrics = EngineMetrics("m")
    llm = AsyncLLM(config, load_tokenizer(config.model), metrics)
    llm.start(timeout_s=180)
    try:
        served = asyncio.run(_generate(llm, work, len(pins), pins))
    finally:
        llm.shutdown()
    return served, metrics.render().decode()


def _gauges(text: str, when: str) -> dict[str, float]:
    pat = rf'dsv4_eplb_imbalance{{layer="([^"]+)",model_name="m",when="{when}"}} (\S+)'
    return {m[1]: float(m[2]) for m in re.finditer(pat, text)}


def test_eplb_on_gives_the_tokens_of_eplb_off_and_re_places_experts() -> None:
    work = skewed(8, seed=3)
    pins: list[int | None] = [None, 1]  # wave 2 on rank 1 only: rank 0 runs dummy batches
    off, off_metrics = serve(BASE, work, pins)
    on_cfg = replace(
        BASE, enable_eplb=True, eplb_redundant_experts=2, eplb_interval=4, eplb_window=8
    )
    on, text = serve(on_cfg, work, pins)
    assert on.tokens == off.tokens
    assert off.stats.eplb is None
    assert 'dsv4_eplb_rearrangements_total{model_name="m"} 0.0' in off_metrics
    found = re.search(r'dsv4_eplb_rearrangements_total{model_name="m"} (\S+)', text)
    assert found is not None and float(found[1]) >= 1, text
    moved = re.search(r'dsv4_eplb_layers_moved_total{model_name="m"} (\S+)', text)
    assert moved is not None and float(moved[1]) >= 1
    before, after = _gauges(text, "before"), _gauges(text, "after")
    assert set(before) == set(after) == {"layers.0", "layers.1", "layers.2", "layers.3", "mtp.0"}
    assert all(a <= b for a, b in zip(after.values(), before.values(), strict=True))
    assert any(a < b for a, b in zip(after.values(), before.values(), strict=True))
    assert on.stats.eplb is not None and on.stats.eplb.step > 0
    print(f"EPLB: {float(found[1]):.0f} re-placements; imbalance {before} -> {after}")
