"""Context parallel composed with DP and with MTP drafting, on dsv4-tiny in 512-token chunks,
against the single-process engine's greedy tokens (the dist tier's near-tie policy):

- DP 2 x CP 2 (4 processes, world = tp x cp x dp): each DP rank's CP pair splits its own
  prompts (waves pinned to rank 0, then 1, then 0 again for a prefix hit) while the other DP
  rank idles through the lockstep's dummy batches;
- CP 2 + MTP 1 (dsv4-tiny and dsv3-small's MLA): the MTP layer's pass over the prompt is split like a layer
  (``CPForward.mtp_forward``): the same tokens, and the same drafts proposed and accepted
  as the single-process MTP engine (random weights accept few or none: the MTP layer's
  logits on every row are ``test_cp_prefill.py``'s check).

Each rank's profile says how many steps (and MTP passes) it ran split: CP really ran."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.worker.worker import PROFILE_ENV
from dsv4_serving.presets.configs import preset_config

from .engine_cases import Work, near_ties, reference, serve_through_front_end

pytestmark = pytest.mark.dist

MODEL = "dsv4-tiny"
PREFIX = 1024  # tokens of the last prompt that are a prefix of the first


def _work() -> Work:
    """Three waves of two, two and one request: a long prompt and a short one, another long
    one and a short one, then the first long prompt's prefix plus 700 new tokens."""
    rng = random.Random(29)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    a, b = prompt(1100), prompt(2000)
    return [(a, 5), (prompt(20), 6), (b, 4), (prompt(24), 5), (a[:PREFIX] + prompt(700), 5)]


def _base(mtp: int, model: str = MODEL) -> EngineConfig:
    return EngineConfig(
        model=model,
        max_model_len=4096,
        num_kv_blocks=16384 // 16,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        num_speculative_tokens=mtp,
        num_prefix_state_snapshots=256,  # a snapshot at every boundary of the shared prefix
        threads_per_rank=1,
        distributed_timeout=300,  # 4 ranks starting on 2 shared cores: minutes apart
    )


def _profiles(folder: Path, ranks: int) -> list[dict[str, float]]:
    return [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(ranks)]


def test_dp2_x_cp2_gives_single_process_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _work()
    want = reference(_base(0), work)
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))  # the ranks inherit it
    cfg = replace(_base(0), context_parallel_size=2, data_parallel_size=2)
    got = serve_through_front_end(cfg, work, [0, 1, 0])
    ties = near_ties(got.tokens, want)
    print(f"dp 2 x cp 2: {len(ties)} near-tie differences {ties}")
    first, second, third = got.wave_rank_stats
    assert second[0].prefix_queries == first[0].prefix_queries  # wave 2 ran on rank 1 only
    assert third[0].prefix_hits - second[0].prefix_hits >= PREFIX // 2  # wave 3 hit wave 1
    split = [p["cp_split_steps"] for p in _profiles(tmp_path, 4)]
    # ranks 0, 1: DP rank 0's CP pair; 2, 3: DP rank 1's; each pair split its own prompts
    assert split[0] == split[1] >= 2 and split[2] == split[3] >= 2, split


@pytest.mark.parametrize("model", [MODEL, "dsv3-small"])
def test_cp2_mtp_drafts_as_one_process(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _work()
    want = reference(_base(0, model), work)
    one = serve_through_front_end(_base(1, model), work, [None, None, None])
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))
    cfg = replace(_base(1, model), context_parallel_size=2)
    got = serve_through_front_end(cfg, work, [None] * 3)
    ties = near_ties(got.tokens, want)
    drafts = [(s.spec_draft_tokens, s.spec_accepted_tokens) for s in (got.stats, one.stats)]
    print(
        f"{model} cp 2 + mtp 1: {len(ties)} near-tie differences {ties}; drafts, accepted {drafts}"
    )
    assert got.stats.spec_draft_tokens > 0
    if got.tokens == one.tokens:  # the same tokens verified: the same drafts, if MTP is exact
        assert got.stats.spec_draft_tokens == one.stats.spec_draft_tokens
        assert got.stats.spec_accepted_tokens == one.stats.spec_accepted_tokens
    profiles = _profiles(tmp_path, 2)
    layers = preset_config(model)["num_hidden_layers"]
    for p in profiles:  # the MTP layer's prompt pass split with every split step
        assert p["cp_split_steps"] >= 2 and p["cp_mtp_split_steps"] == p["cp_split_steps"], p
        assert p["cp_gathers"] == p["cp_split_steps"] * (layers + 1), p
