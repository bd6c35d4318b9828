"""A non-streamed answer (``AsyncLLM.generate(collect=True)``): after its first increment the
front end holds each step's tokens undecoded and hands the consumer one last increment, whose
text, token ids and logprobs are exactly what the streamed increments of the same outputs add
up to; with stop strings every step is decoded as before (they need each step's text)."""

from __future__ import annotations

import asyncio

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.engine.async_llm import AsyncLLM, RequestOutput
from dsv4_serving.engine.engine.messages import Outputs
from dsv4_serving.engine.engine.tokenizer import load_tokenizer
from dsv4_serving.engine.request import EngineCoreOutput, Logprob
from dsv4_serving.engine.sample.sampling_params import SamplingParams

# byte-level ids of dsv4-tiny: "é" is 0xC3 0xA9, split over two steps; 32 is a space
STEPS = [[104], [0xC3], [0xA9, 105], [32, 0xE2, 0x82], [0xAC], [33, 106]]
ALL_IDS = [t for ids in STEPS for t in ids]


class Alive:
    def __init__(self) -> None:
        self.procs, self.alive = [None], True

    def first_dead(self) -> None:
        return None


def _llm() -> tuple[AsyncLLM, list[object]]:
    llm = AsyncLLM(EngineConfig(model="dsv4-tiny"), load_tokenizer("dsv4-tiny"))
    llm._ranks = Alive()  # type: ignore[assignment]
    sent: list[object] = []
    llm._send = sent.append  # type: ignore[method-assign]
    return llm, sent


def _lps(ids: list[int]) -> list[Logprob]:
    return [Logprob(t, -0.5, [(t, -0.5)]) for t in ids]


async def _run(collect: bool, stop: list[str]) -> tuple[list[RequestOutput], int]:
    """The consumer's increments of one request fed ``STEPS``, and the mailbox's puts."""
    llm, _ = _llm()
    params = SamplingParams(max_tokens=len(ALL_IDS), logprobs=1, stop=stop)
    gen = llm.generate([1, 2, 3], params, "r", collect=collect)
    got: list[RequestOutput] = []

    async def consume() -> None:
        async for o in gen:
            got.append(o)

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0)  # the request is registered
    box = llm._states["r"].box
    for i, ids in enumerate(STEPS):
        last = i == len(STEPS) - 1
        out = EngineCoreOutput("r", ids, _lps(ids), finish_reason="length" if last else None)
        llm._dispatch(Outputs([out], SchedulerStats()))
        await asyncio.sleep(0)  # the consumer keeps up: a streamed one takes every step
        await asyncio.sleep(0)
    await task
    return got, box.puts


def _joined(outs: list[RequestOutput]) -> tuple[str, list[int], list[int]]:
    lps = [lp.token_id for o in outs for lp in o.delta_logprobs or ()]
    return "".join(o.delta_text for o in outs), [t for o in outs for t in o.delta_token_ids], lps


def test_a_collected_answer_gets_its_first_and_last_increment_only() -> None:
    streamed, streamed_puts = asyncio.run(_run(collect=False, stop=[]))
    collected, collected_puts = asyncio.run(_run(collect=True, stop=[]))
    assert streamed_puts == len(STEPS) and collected_puts == 2
    assert len(collected) == 2 and collected[0].delta_token_ids == STEPS[0]
    assert _joined(collected) == _joined(streamed) == ("héi €!j", ALL_IDS, ALL_IDS)
    last = collected[-1]
    assert (last.finished, last.finish_reason, last.num_output_tokens) == (True, "length", 10)


def test_stop_strings_are_still_checked_each_step() -> None:
    collected, puts = asyncio.run(_run(collect=True, stop=["€"]))
    streamed, _ = asyncio.run(_run(collect=False, stop=["€"]))
    assert puts > 2  # decoded each step: the stop string is found when it appears
    assert _joined(collected)[0] == _joined(streamed)[0] == "héi "
    assert collected[-1].finish_reason == "stop" and collected[-1].stop_reason == "€"
