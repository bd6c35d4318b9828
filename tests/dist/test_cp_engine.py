"""The engine with context-parallel prefill (``-cp``) serves the single-process engine's greedy
tokens (the dist tier's near-tie policy): CP 2 and TP 2 x CP 2 on dsv4-tiny and dsv3-small
(MLA), 1K-3K-token prompts (several windows and compressed blocks of each kind), in
512-token chunks (CP 2: each chunk split zig-zag over the CP ranks) and unchunked
(TP 2 x CP 2, ``enable_chunked_prefill`` off: each prompt split in one step), and a 16K-token
prompt on the long-context preset (V4's real ratios) in 4K-token chunks. Each instance serves
two waves, the second's long prompt hitting the first's prefix, with a short prompt and
decodes (run unsplit on every CP rank) beside them, with async scheduling on (the core's
step thread runs the CP forward). Each rank's profile says how many steps
it ran split and what their gathers moved: CP really ran."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.worker.worker import PROFILE_ENV
from dsv4_serving.presets.configs import preset_config

from .engine_cases import Reference, Work, near_ties, reference, serve_through_front_end

pytestmark = pytest.mark.dist

CASES = [
    # (model, tp, cp, chunked)
    ("dsv4-tiny", 1, 2, True),
    ("dsv4-tiny", 2, 2, False),
    ("dsv3-small", 1, 2, True),
    ("dsv3-small", 2, 2, False),
    ("dsv4-tiny-long", 1, 2, True),
]
LONG = "dsv4-tiny-long"


def _work(model: str) -> tuple[Work, int]:
    """Two waves (two requests, then the rest), and how many tokens of wave 2's long prompt
    are a prefix of wave 1's."""
    rng = random.Random(29)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    if model == LONG:  # 16K in 4 chunks beside a short one; wave 2: 8K of it again + 500
        a, d = prompt(16384), prompt(20)
        return [(a, 4), (d, 6), (a[:8192] + prompt(500), 4)], 8192
    a, b, d = prompt(1100), prompt(3000), prompt(20)
    return [(a, 5), (b, 4), (a[:1024] + prompt(700), 5), (d, 6)], 1024


def _base(model: str, chunked: bool = True) -> EngineConfig:
    block = 128 if model == LONG else 16
    budget = 4096 if model == LONG or not chunked else 512
    return EngineConfig(
        model=model,
        max_model_len=16512 if model == LONG else 4096,
        num_kv_blocks=(40960 if model == LONG else 16384) // block,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        num_speculative_tokens=0,
        num_prefix_state_snapshots=256,  # a snapshot at every boundary of the shared prefix
        threads_per_rank=1,
        distributed_timeout=300,  # 4 ranks starting on 2 shared cores: minutes apart
    )


_REFS: dict[str, Reference] = {}


def _reference(model: str) -> Reference:
    """One process, each request alone; once per model for the cases run."""
    if model not in _REFS:
        _REFS[model] = reference(_base(model), _work(model)[0])
    return _REFS[model]


@pytest.mark.parametrize(
    ("model", "tp", "cp", "chunked"),
    CASES,
    ids=[f"{m}-tp{t}-cp{c}-{'chunked' if k else 'whole'}" for m, t, c, k in CASES],
)
def test_cp_engine_gives_single_process_tokens(
    model: str,
    tp: int,
    cp: int,
    chunked: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = _reference(model)
    work, prefix = _work(model)
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))  # the ranks inherit it
    # async scheduling on (refused where not exact): the step thread runs the CP forward
    cfg = replace(
        _base(model, chunked),
        tensor_parallel_size=tp,
        context_parallel_size=cp,
        async_scheduling="on",
    )
    got = serve_through_front_end(cfg, work, [None, None])
    ties = near_ties(got.tokens, want)
    print(f"{model} tp {tp} cp {cp} chunked {chunked}: {len(ties)} near-tie differences {ties}")
    assert got.stats.prefix_hits >= prefix // 2  # wave 2 reused wave 1's blocks
    profiles = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(tp * cp)]
    split = [p["cp_split_steps"] for p in profiles]
    assert min(split) >= 2 and len(set(split)) == 1, split  # every rank split the same steps
    assert all(p["steps"] > max(split) for p in profiles)  # the decodes ran unsplit
    layers = preset_config(model)["num_hidden_layers"]
    for p in profiles:  # one gather per attention layer of each split step, both ways
        assert p["cp_gathers"] == p["cp_split_steps"] * layers, p
        assert p["cp_bytes_sent"] > 0 and p["cp_bytes_received"] > 0, p
