"""What running the engine's ranks as processes costs on this machine: the same workload
(dsv3-small, dummy weights, N requests of P prompt and O output tokens, greedy, ignore_eos)
through the front end (``AsyncLLM``) with

- TP 1, one process with 2 torch threads (the baseline),
- TP 2, two ranks with 1 thread each,
- DP 2 (EP 2), two ranks with 1 thread each,
- CP 1 (one process, 2 threads) and CP 2 (two context-parallel ranks, 1 thread each): long
  prefill, on dsv4-tiny-long unless ``--model`` says otherwise (``--layouts cp1,cp2
  --requests 1 --prompt 32768 --output 1``),

on the same CPUs: output and prompt tokens/s of each, the ratio to the first layout, and each
layout's time in collectives per forward step (each rank measures it, ``DSV4_COMM_PROFILE``;
waiting for a slower peer counts too). Under CP each rank also counts its per-layer gathers
(``attention/cp.py:CPStats``): printed per attention layer of a split step (bytes received
and milliseconds inside the gather, the warm-up's steps included) and per layer over the
whole run. Two cores cannot show a speed-up; the ratio shows the overhead. A layout name
ending in ``-gloo`` (``tp2-gloo``) runs with the shared-memory collectives off
(``DSV4_SHM_COMM=0``): the A/B of ``distributed/shm_comm.py``.

    .venv/bin/python benchmarks/parallel.py [--requests 64] [--prompt 64] [--output 32]
        [--layouts tp1,tp2,dp2,tp2-gloo,dp2-gloo] [--model dsv3-small] [--chunk 2048]
    .venv/bin/python benchmarks/parallel.py --layouts cp1,cp2 --requests 1 --prompt 32768 \
        --output 1
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
    "cp1": {"threads_per_rank": 2},
    "cp2": {"context_parallel_size": 2, "threads_per_rank": 1},
}
WARMUP_PROMPT = 64  # tokens: a warm-up too short to split, that shares no prefix


@dataclass(frozen=True, slots=True)
class Result:
    layout: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    comm_s_per_step: float  # rank 0's
    comm_s_per_step_mean: float  # over every rank
    steps: int  # rank 0's forward steps
    calls_per_step: float  # rank 0's collectives per forward step
    cp: CPCost | None = None  # rank 0's CP gathers (CP layouts)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.seconds


@dataclass(frozen=True, slots=True)
class CPCost:
    """One CP rank's gathers (``CPStats`` from its profile) over ``layers`` attention layers."""

    split_steps: int
    gathers: int
    bytes_received: int
    seconds: float
    layers: int
    threads: int  # the rank's torch threads as it ran

    def per_gather(self) -> tuple[float, float]:
        """(MiB received, ms) per gather: one attention layer of one split step."""
        n = max(1, self.gathers)
        return self.bytes_received / n / 2**20, 1e3 * self.seconds / n

    def per_layer(self) -> tuple[float, float]:
        """(MiB received, ms) per attention layer over the whole run."""
        n = max(1, self.layers)
        return self.bytes_received / n / 2**20, 1e3 * self.seconds / n


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

    warm = _prompts(1, min(WARMUP_PROMPT, len(prompts[0])), seed=1)[0]
    await one(-1, warm, 4)  # warm-up: first-step costs out of the figure, no prefix shared
    t = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p, output) for i, p in enumerate(prompts)))
    return sum(counts), time.perf_counter() - t


def _model(name: str) -> tuple[int, int]:
    """(KV block size, attention layers) of preset ``name``, as the engine resolves them."""
    from dsv4_serving.engine.worker.model_loader import default_block_size
    from dsv4_serving.models.registry import REGISTRY
    from dsv4_serving.presets.configs import preset_config

    cfg = preset_config(name)
    mc = REGISTRY.resolve(cfg["architectures"][0]).config_class.from_dict(cfg)
    return default_block_size(mc), mc.num_hidden_layers


def run_layout(name: str, prompts: list[list[int]], output: int, model: str, chunk: int) -> Result:
    from dsv4_serving.distributed.shm_comm import DISABLE_ENV
    from dsv4_serving.engine.config import EngineConfig
    from dsv4_serving.engine.engine.async_llm import AsyncLLM
    from dsv4_serving.engine.engine.tokenizer import load_tokenizer
    from dsv4_serving.engine.worker.worker import PROFILE_ENV

    gloo = name.endswith("-gloo")
    block, layers = _model(model)
    per_seq = -(-(max(len(p) for p in prompts) + output + 8) // block) + 1
    config = EngineConfig(
        model=model,
        max_model_len=max(len(p) for p in prompts) + output + 8,
        num_kv_blocks=(len(prompts) + 1) * per_seq,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=chunk,
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
    cp = None
    if ranks and config.context_parallel_size > 1:
        r0 = ranks[0]
        cp = CPCost(
            r0["cp_split_steps"],
            r0["cp_gathers"],
            r0["cp_bytes_received"],
            r0["cp_gather_s"],
            layers,
            r0.get("cp_threads", 0),
        )
    return Result(
        name,
        seconds,
        tokens,
        sum(len(p) for p in prompts),
        per_step[0],
        sum(per_step) / len(per_step),
        steps,
        calls,
        cp,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--layouts", default="tp1,tp2,dp2")
    ap.add_argument(
        "--model", default=None, help="default: dsv4-tiny-long for CP layouts, else dsv3-small"
    )
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    a = ap.parse_args()
    layouts = a.layouts.split(",")
    if unknown := [n for n in layouts if n.removesuffix("-gloo") not in LAYOUTS]:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)} (and -gloo)")
    model = a.model or (
        "dsv4-tiny-long" if any(n.startswith("cp") for n in layouts) else "dsv3-small"
    )
    prompts = _prompts(a.requests, a.prompt)
    results = [run_layout(name, prompts, a.output, model, a.chunk) for name in layouts]
    _report(results, model, a)


def _report(results: list[Result], model: str, a: argparse.Namespace) -> None:
    base = next((r for r in results if r.layout in ("tp1", "cp1")), results[0])
    print(f"{model}, {a.requests} requests x {a.prompt} prompt + {a.output} output tokens")
    print(
        f"{'layout':9} {'tok/s':>8} {'x ' + base.layout:>7} {'prompt tok/s':>12} "
        f"{'x ' + base.layout:>7} {'steps':>6} {'comm ms/step':>13} {'(mean)':>8} "
        f"{'calls/step':>10}"
    )
    for r in results:
        print(
            f"{r.layout:9} {r.tok_s:8.1f} {r.tok_s / base.tok_s:7.2f} {r.prompt_tok_s:12.1f} "
            f"{r.prompt_tok_s / base.prompt_tok_s:7.2f} {r.steps:6d} "
            f"{1e3 * r.comm_s_per_step:13.2f} {1e3 * r.comm_s_per_step_mean:8.2f} "
            f"{r.calls_per_step:10.1f}"
        )
    for r in results:
        if r.cp is None:
            continue
        (gm, gms), (lm, lms) = r.cp.per_gather(), r.cp.per_layer()
        print(
            f"{r.layout} rank 0 ({r.cp.threads} thread{'s' * (r.cp.threads > 1)}): "
            f"{r.cp.split_steps} split steps, {r.cp.gathers} gathers; per "
            f"layer and split step {gm:.2f} MiB received in {gms:.2f} ms; per layer over the "
            f"run {lm:.1f} MiB in {lms:.1f} ms"
        )


if __name__ == "__main__":
    main()
