"""Penalties and logit_bias through the real engine core (dsv4-tiny): penalties change greedy
output, a +100 bias forces its token, and MTP on or off gives the same greedy tokens with
penalties (each draft is judged with the counts of the tokens before it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.request import EngineCoreRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams

from .common import pass_through_checkpoint, workload

PENALTIES = {"frequency_penalty": 2.0, "presence_penalty": 1.0, "repetition_penalty": 3.0}


def run_with(core: EngineCore, work: list[tuple[list[int], int]], **kw: object) -> list[list[int]]:
    """Greedy, ignore_eos, all requests at once, with these sampling parameters."""
    got: dict[str, list[int]] = {}
    for i, (prompt, mt) in enumerate(work):
        sp = SamplingParams(temperature=0, max_tokens=mt + 12, ignore_eos=True, **kw)  # type: ignore[arg-type]
        core.add_request(EngineCoreRequest(str(i), prompt, sp))
        got[str(i)] = []
    for _ in range(20000):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            got[o.request_id].extend(o.new_token_ids)
    assert not core.has_unfinished_requests()
    return [got[str(i)] for i in range(len(work))]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    path = tmp_path_factory.mktemp("pass-through")
    pass_through_checkpoint(path)  # next token = f(current): drafts are (nearly) always right
    return EngineConfig(
        model=str(path), max_model_len=256, num_kv_blocks=400, num_speculative_tokens=0
    )


def test_penalties_change_greedy_output(base: EngineConfig) -> None:
    work = workload(4, 5)
    plain = run_with(EngineCore(base), work)
    assert run_with(EngineCore(base), work, **PENALTIES) != plain


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_on_and_off_give_the_same_tokens_with_penalties(base: EngineConfig, k: int) -> None:
    work = workload(6, 7)
    want = run_with(EngineCore(base), work, **PENALTIES)
    core = EngineCore(replace(base, num_speculative_tokens=k))
    assert run_with(core, work, **PENALTIES) == want
    assert core.stats().spec_draft_tokens > 0


def test_a_plus_100_bias_forces_its_token_with_and_without_drafts(base: EngineConfig) -> None:
    work = workload(3, 9)
    for k in (0, 2):
        core = EngineCore(replace(base, num_speculative_tokens=k))
        for toks in run_with(core, work, logit_bias={42: 100.0}):
            assert set(toks) == {42}
    random_tiny = EngineConfig(model="dsv4-tiny", max_model_len=256, num_kv_blocks=400)
    for toks in run_with(EngineCore(random_tiny), work, logit_bias={42: 100.0}):
        assert set(toks) == {42}
