"""Structured outputs: the engine's output tokens/s with a JSON schema per request beside the
same load without one, and the grammar compile time over the schema corpus.

    .venv/bin/python benchmarks/structured.py [--preset dsv3-small] [--concurrency 32]
        [--requests 96] [--max-tokens 128] [--speculative 0] [--compile-reps 5]

An in-process engine core (random weights), closed loop: ``--concurrency`` requests in flight,
each finished one replaced until ``--requests`` have finished. Free text runs to
``--max-tokens`` (EOS ignored); a JSON request ends when its schema's value is complete (or at
``--max-tokens``), greedy, closers favoured (a random-weight model rambles). The figure is the
ratio json / free of output tokens/s (goal: at least 0.9). Compile: each corpus schema compiled
afresh ``--compile-reps`` times (no cache), p50 and p99 over all of them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.engine.tokenizer import load_tokenizer
from dsv4_serving.engine.request import EngineCoreRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend
from dsv4_serving.structured.schema_corpus import schemas
from dsv4_serving.structured.spec import GrammarSpec, spec_from_request

CLOSERS = {ord(c): 6.0 for c in '"}],'}


def corpus_specs() -> list[GrammarSpec]:
    out = []
    for case in schemas():
        rf = {
            "type": "json_schema",
            "json_schema": {"name": case["name"], "schema": case["schema"]},
        }
        spec = spec_from_request(rf)
        assert spec is not None
        out.append(spec)
    return out


def run_load(
    core: EngineCore,
    prompt: list[int],
    n: int,
    concurrency: int,
    params: Callable[[int], SamplingParams],
) -> tuple[int, float]:
    """(output tokens, seconds) of ``n`` requests, ``concurrency`` in flight."""
    started = finished = tokens = 0
    t0 = time.perf_counter()
    while finished < n:
        while started < n and started - finished < concurrency:
            core.add_request(EngineCoreRequest(f"r{started}", prompt, params(started)))
            started += 1
        for o in core.step():
            tokens += len(o.new_token_ids)
            finished += o.finish_reason is not None
    return tokens, time.perf_counter() - t0


def throughput(args: argparse.Namespace) -> dict[str, float]:
    config = EngineConfig(
        model=args.preset,
        max_model_len=1024,
        num_kv_blocks=max(64, args.concurrency * 8),
        max_num_seqs=args.concurrency,
        num_speculative_tokens=args.speculative,
    )
    core = EngineCore(config)
    prompt = load_tokenizer(args.preset).encode("Answer in JSON, please.")
    specs = corpus_specs()
    mt = args.max_tokens

    def free(i: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True, logit_bias=CLOSERS)

    def json_(i: int) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=mt, logit_bias=CLOSERS, structured=specs[i % len(specs)]
        )

    run_load(core, prompt, args.concurrency, args.concurrency, json_)  # warm: compiles cached
    out = {}
    for name, fn in (("free", free), ("json", json_)):
        toks, secs = run_load(core, prompt, args.requests, args.concurrency, fn)
        out[f"{name}_tokens"], out[f"{name}_tok_s"] = toks, toks / secs
    core.close()
    return out


def compile_times(preset: str, reps: int) -> list[float]:
    tok = load_tokenizer(preset)
    eos = tok.token_id(tok.eos_token or "")
    backend = LLGuidanceBackend(tok.hf, [eos if eos is not None else 0], tok.vocab_size)
    times = []
    for spec in corpus_specs():
        for _ in range(reps):
            t = time.perf_counter()
            backend.compile(spec).matcher()
            times.append(time.perf_counter() - t)
    return times


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="dsv3-small")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--speculative", type=int, default=0, help="MTP draft tokens (0-3)")
    p.add_argument("--compile-reps", type=int, default=5)
    args = p.parse_args()
    r = throughput(args)
    times = compile_times(args.preset, args.compile_reps)
    print(
        f"{args.preset}, {args.concurrency} in flight, {args.requests} requests, MTP {args.speculative}"
    )
    print(f"{'load':<8}{'output tokens':>15}{'tok/s':>10}")
    for name in ("free", "json"):
        print(f"{name:<8}{r[name + '_tokens']:>15.0f}{r[name + '_tok_s']:>10.1f}")
    print(f"ratio json/free: {r['json_tok_s'] / r['free_tok_s']:.2f}x (goal >= 0.9x)")
    print(
        f"compile ({len(times)} over {len(times) // args.compile_reps} schemas): "
        f"p50 {1e3 * statistics.median(times):.2f} ms, p99 {1e3 * percentile(times, 0.99):.2f} ms"
    )


if __name__ == "__main__":
    main()
