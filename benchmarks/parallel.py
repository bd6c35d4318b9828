"""What running the engine's ranks as processes costs on this machine: the same workload
(dsv3-small, dummy weights, N requests of P prompt and O output tokens, greedy, ignore_eos)
through the front end (``AsyncLLM``) with

- TP 1, one process with 2 torch threads (the baseline),
- TP 2, two ranks with 1 thread each,
- DP 2 (EP 2), two ranks with 1 thread each,

on the same CPUs: output tokens/s of each, the ratio to TP 1, and each layout's time in
collectives per forward step (each rank measures it, ``DSV4_COMM_PROFILE``; waiting for a
slower peer counts too). Two cores cannot show a speed-up; the ratio shows the overhead.
A layout name ending in ``-gloo`` (``tp2-gloo``) runs with the shared-memory collectives off
(``DSV4_SHM_COMM=0``): the A/B of ``distributed/shm_comm.py``.

    .venv/bin/python benchmarks/parallel.py [--requests 64] [--prompt 64] [--output 32]
        [--layouts tp1,tp2,dp2,tp2-gloo,dp2-gloo]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYOUTS: dict[str, dict[str, int]] = {
    "tp1": {"threads_per_rank": 2},
    "tp2": {"tensor_parallel_size": 2, "threads_per_rank": 1},
    "dp2": {"data_parallel_size": 2, "expert_parallel_size": 2, "threads_per_rank": 1},
}


@dataclass(frozen=True, slots=True)
class Result:
    layout: str
    seconds: float
    output_tokens: int
    comm_s_per_step: float  # rank 0's
    comm_s_per_step_mean: float  # over every rank
    steps: int  # rank 0's forward steps
    calls_per_step: float  # rank 0's collectives per forward step

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


async def _serve(llm: Any, prompts: list[list[int]], output: int) -> tuple[int, float]:
    """(output tokens, seconds) of the whole workload at once, after a warm-up request."""
    from dsv4_serving.engine.sample.sampling_params import SamplingParams

    llm.attach(asyncio.get_running_loop())

    async def one(i: int, prompt: list[int], max_tokens: int) -> int:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        n = 0
        async for o in llm.generate(prompt, sp, f"{i}-{max_tokens}"):
            n += len(o.delta_token_ids)
        return n

    await one(-1, prompts[0], 4)  # warm-up: first-step costs out of the figure
    t = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p, output) for i, p in enumerate(prompts)))
    return sum(counts), time.perf_counter() - t


def run_layout(name: str, prompts: list[list[int]], output: int) -> Result:
    from dsv4_serving.distributed.shm_comm import DISABLE_ENV
    from dsv4_serving.engine.config import EngineConfig
    from dsv4_serving.engine.engine.async_llm import AsyncLLM
    from dsv4_serving.engine.engine.tokenizer import load_tokenizer
    from dsv4_serving.engine.worker.worker import PROFILE_ENV

    gloo = name.endswith("-gloo")
    config = EngineConfig(
        model="dsv3-small",
        max_model_len=max(len(p) for p in prompts) + output + 8,
        num_kv_blocks=len(prompts) * (-(-(len(prompts[0]) + output + 8) // 16) + 1),
        max_num_seqs=len(prompts),
        num_speculative_tokens=0,
        **LAYOUTS[name.removesuffix("-gloo")],  # type: ignore[arg-type]
    )
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[PROFILE_ENV] = tmp
        if gloo:
            os.environ[DISABLE_ENV] = "0"  # the ranks inherit it when spawned
        llm = AsyncLLM(config, load_tokenizer(config.model))
        llm.start(timeout_s=300)
        try:
            tokens, seconds = asyncio.run(_serve(llm, prompts, output))
        finally:
            llm.shutdown()
            del os.environ[PROFILE_ENV]
            os.environ.pop(DISABLE_ENV, None)
        ranks = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank-*.json"))]
    per_step = [r["comm_s"] / max(1, r["steps"]) for r in ranks] or [0.0]
    steps = ranks[0]["steps"] if ranks else 0
    calls = ranks[0]["comm_calls"] / max(1, steps) if ranks else 0.0
    return Result(name, seconds, tokens, per_step[0], sum(per_step) / len(per_step), steps, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--layouts", default="tp1,tp2,dp2")
    a = ap.parse_args()
    prompts = _prompts(a.requests, a.prompt)
    results = [run_layout(name, prompts, a.output) for name in a.layouts.split(",")]
    base = next((r for r in results if r.layout == "tp1"), results[0])
    print(f"dsv3-small, {a.requests} requests x {a.prompt} prompt + {a.output} output tokens")
    print(
        f"{'layout':9} {'tok/s':>8} {'x tp1':>6} {'steps':>6} {'comm ms/step':>13} {'(mean)':>8} "
        f"{'calls/step':>10}"
    )
    for r in results:
        print(
            f"{r.layout:9} {r.tok_s:8.1f} {r.tok_s / base.tok_s:6.2f} {r.steps:6d} "
            f"{1e3 * r.comm_s_per_step:13.2f} {1e3 * r.comm_s_per_step_mean:8.2f} "
            f"{r.calls_per_step:10.1f}"
        )


if __name__ == "__main__":
    main()
