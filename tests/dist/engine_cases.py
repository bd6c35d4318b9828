"""The parallel engine against the single-process one: greedy tokens of a mixed workload.

The reference runs each request alone in one process with top-2 logprobs, so wherever a
parallel run picks another token the test can tell a near tie (TP sums floats in another
order) from a real error: a differing token is accepted only where the reference's top-2
logit margin (= logprob margin) is below ``NEAR_TIE``, and the rest of that request is then
free to differ.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.engine.async_llm import AsyncLLM
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.engine.tokenizer import load_tokenizer
from dsv4_serving.engine.request import EngineCoreRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams

NEAR_TIE = 1e-3
Work = list[tuple[list[int], int]]


@dataclass(frozen=True, slots=True)
class Reference:
    tokens: dict[int, list[int]]
    margins: dict[int, list[float]]  # top-2 logit margin at each output position


def reference(config: EngineConfig, work: Work) -> Reference:
    """Each request alone, one process, no prefix cache, no drafts."""
    one = replace(config, max_num_seqs=1, enable_prefix_caching=False, num_speculative_tokens=0)
    core = EngineCore(one)
    toks: dict[int, list[int]] = {}
    margins: dict[int, list[float]] = {}
    for i, (prompt, mt) in enumerate(work):
        sp = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True, logprobs=2)
        core.add_request(EngineCoreRequest(str(i), prompt, sp))
        toks[i], margins[i] = [], []
        while core.has_unfinished_requests():
            for o in core.step():
                toks[i].extend(o.new_token_ids)
                for lp in o.new_logprobs or []:
                    margins[i].append(lp.top[0][1] - lp.top[1][1])
    return Reference(toks, margins)


@dataclass(frozen=True, slots=True)
class Served:
    tokens: dict[int, list[int]]
    stats: SchedulerStats  # the instance's, at the end
    wave_rank_stats: list[tuple[SchedulerStats, ...]]  # each DP rank's, after each wave


async def _generate(llm: AsyncLLM, work: Work, waves: int, pins: list[int | None]) -> Served:
    llm.attach(asyncio.get_running_loop())

    async def one(i: int, pin: int | None) -> list[int]:
        prompt, mt = work[i]
        sp = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
        got: list[int] = []
        async for o in llm.generate(prompt, sp, str(i), data_parallel_rank=pin):
            got.extend(o.delta_token_ids)
        return got

    out: dict[int, list[int]] = {}
    ranks = []
    per = -(-len(work) // waves)
    for w in range(waves):
        ids = range(w * per, min(len(work), (w + 1) * per))
        for i, toks in zip(ids, await asyncio.gather(*(one(i, pins[w]) for i in ids)), strict=True):
            out[i] = toks
        ranks.append(llm.rank_stats)
    return Served(out, llm.stats, ranks)


def serve_through_front_end(config: EngineConfig, work: Work, pins: list[int | None]) -> Served:
    """``work`` through ``AsyncLLM`` (which spawns the ranks) in ``len(pins)`` waves, one
    after the other, each pinned to its DP rank (None: the engine routes)."""
    llm = AsyncLLM(config, load_tokenizer(config.model))
    llm.start(timeout_s=180)
    try:
        return asyncio.run(_generate(llm, work, len(pins), pins))
    finally:
        llm.shutdown()


def near_ties(got: dict[int, list[int]], ref: Reference) -> list[str]:
    """Requests whose first differing token is a near tie in the reference (reported);
    raises AssertionError for any other difference."""
    ties = []
    for i, want in ref.tokens.items():
        have = got[i]
        assert len(have) == len(want), (i, have, want)
        j = next((j for j, (a, b) in enumerate(zip(have, want, strict=True)) if a != b), None)
        if j is None:
            continue
        margin = ref.margins[i][j]
        assert margin < NEAR_TIE, (
            f"request {i} differs at output token {j} ({have[j]} vs {want[j]}) where the "
            f"single-process top-2 margin is {margin:.2e}, not a near tie: {have} vs {want}"
        )
        ties.append(f"#{i}@{j} (margin {margin:.1e})")
    return ties
