"""The engine with context-parallel prefill (``-cp``) serves the single-process engine's greedy
tokens: CP 2 and TP 2 x CP 2 on dsv4-tiny and its long-context preset (V4's real ratios), on
prompts of 1K-3K tokens (several windows and compressed blocks of each kind), in 512-token
prefill chunks (each split zig-zag over the CP ranks), with a second wave whose prompt hits
the first wave's prefix, and short prompts and decodes (run unsplit on every CP rank) beside
them. Each rank's profile says how many steps it ran split: CP really ran."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.worker.worker import PROFILE_ENV

from .engine_cases import Reference, near_ties, reference, serve_through_front_end

pytestmark = pytest.mark.dist

CASES = [
    # (model, tp, cp)
    ("dsv4-tiny", 1, 2),
    ("dsv4-tiny-long", 1, 2),
    ("dsv4-tiny", 2, 2),
    ("dsv4-tiny-long", 2, 2),
]
PREFIX = 1024  # wave 2's long prompt starts with wave 1's first 1024 tokens


def _work() -> list[tuple[list[int], int]]:
    rng = random.Random(29)
    a = [rng.randrange(256) for _ in range(1100)]
    b = [rng.randrange(256) for _ in range(2300)]
    c = a[:PREFIX] + [rng.randrange(256) for _ in range(700)]
    d = [rng.randrange(256) for _ in range(20)]
    return [(a, 5), (b, 4), (c, 5), (d, 6)]


def _base(model: str) -> EngineConfig:
    block = 128 if model.endswith("-long") else 16
    return EngineConfig(
        model=model,
        max_model_len=3072,
        num_kv_blocks=16384 // block,
        max_num_seqs=4,
        max_num_batched_tokens=512,  # chunked prefill: each long prompt takes several steps
        num_speculative_tokens=0,
        num_prefix_state_snapshots=256,  # a snapshot at every boundary of the shared prefix
        threads_per_rank=1,
        distributed_timeout=300,  # 4 ranks starting on 2 shared cores: minutes apart
    )


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    """One process, each request alone."""
    return {m: reference(_base(m), _work()) for m in ("dsv4-tiny", "dsv4-tiny-long")}


@pytest.mark.parametrize(
    ("model", "tp", "cp"), CASES, ids=[f"{m}-tp{t}-cp{c}" for m, t, c in CASES]
)
def test_cp_engine_gives_single_process_tokens(
    references: dict[str, Reference],
    model: str,
    tp: int,
    cp: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))  # the ranks inherit it
    cfg = replace(_base(model), tensor_parallel_size=tp, context_parallel_size=cp)
    got = serve_through_front_end(cfg, _work(), [None, None])
    ties = near_ties(got.tokens, references[model])
    print(f"{model} tp {tp} cp {cp}: {len(ties)} near-tie differences {ties}")
    assert got.stats.prefix_hits >= PREFIX // 2  # wave 2 reused wave 1's blocks
    profiles = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(tp * cp)]
    split = [p["cp_split_steps"] for p in profiles]
    assert min(split) >= 2 and len(set(split)) == 1, split  # every rank split the same steps
    assert all(p["steps"] > max(split) for p in profiles)  # the decodes ran unsplit
