"""MTP drafts are accepted when they are right: a checkpoint whose next token depends only on
the current one (attention and FFN outputs zeroed, so every block passes its streams through)
and whose MTP layer computes the same function must accept (nearly) every draft, and still
give exactly the tokens of decoding without drafts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore

from .common import alone, pass_through_checkpoint, run, workload


@pytest.mark.parametrize("k", [1, 3])
def test_right_drafts_are_accepted_and_tokens_unchanged(tmp_path: Path, k: int) -> None:
    pass_through_checkpoint(tmp_path)
    base = EngineConfig(
        model=str(tmp_path), max_model_len=256, num_kv_blocks=400, num_speculative_tokens=0
    )
    work = workload(8, 3)
    want = alone(replace(base, max_num_seqs=1, enable_prefix_caching=False), work)
    core = EngineCore(replace(base, num_speculative_tokens=k))
    got = run(core, work)
    assert got == want
    st = core.stats()
    assert st.spec_accepted_tokens / st.spec_draft_tokens > 0.9
    assert core.kv.num_free_blocks == 400
