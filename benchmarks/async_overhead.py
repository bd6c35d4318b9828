"""The engine core's host overhead per step, synchronous against async scheduling: an
in-process EMULATED engine core (every step sleeps ``--step-ms``, the device's step), ``N``
sequences decoding together, and the achieved step rate against the ideal one.

    .venv/bin/python benchmarks/async_overhead.py [--seqs 1 16 64 128 256] [--tokens 200]
        [--step-ms 10] [--preset dsv4-tiny] [--mtp K]

The core alone (scheduling, block tables, outputs; no HTTP, no detokenisation, those run in
the front end's process): with a device step of fixed length, achieved/ideal is the share of
the time the device would be busy, and ``host ms/step`` is what the core adds to each step
(synchronous: all of its work; async: what it could not hide behind the step). Use an idle
machine; figures go on docs/measurements.md with the machine's CPU.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.request import EngineCoreRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Run:
    mode: str  # "off" (synchronous) or "on" (async)
    seqs: int
    steps: int  # forwards
    seconds: float
    step_ms: float

    @property
    def achieved_over_ideal(self) -> float:
        return self.steps * self.step_ms / 1e3 / self.seconds

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps - self.step_ms


def measure(mode: str, seqs: int, tokens: int, step_ms: float, preset: str, mtp: int = 0) -> Run:
    """``seqs`` requests of 8 prompt tokens and ``tokens`` output tokens, all at once;
    ``mtp`` drafts per step (the EMULATED runner's drafts are all accepted)."""
    config = EngineConfig(
        model=preset,
        emulate_step_time=f"{step_ms:g},0,0",
        num_speculative_tokens=mtp,
        max_num_seqs=max(seqs, 1),
        max_num_batched_tokens=max(2048, (8 + mtp) * seqs),
        max_model_len=8 + tokens + 8,
        num_kv_blocks=seqs * (-(-(8 + tokens + 8 + 2 * mtp) // 16) + 1) + 8,
        async_scheduling=mode,  # type: ignore[arg-type]
    )
    core = EngineCore(config)
    try:
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        for i in range(seqs):
            core.add_request(EngineCoreRequest(str(i), [100 + (i + j) % 50 for j in range(8)], sp))
        start, forwards = time.perf_counter(), core.runner.forwards
        while core.has_unfinished_requests():
            core.step()
        seconds = time.perf_counter() - start
        return Run(mode, seqs, core.runner.forwards - forwards, seconds, step_ms)
    finally:
        core.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    p.add_argument("--tokens", type=int, default=200, help="output tokens per sequence")
    p.add_argument("--step-ms", type=float, default=10.0, help="the emulated device step")
    p.add_argument("--preset", default="dsv4-tiny")
    p.add_argument("--mtp", type=int, default=0, help="MTP draft tokens per step")
    args = p.parse_args()
    print(f"{'seqs':>5} {'mode':>6} {'steps':>6} {'achieved/ideal':>15} {'host ms/step':>13}")
    for n in args.seqs:
        for mode in ("off", "on"):
            r = measure(mode, n, args.tokens, args.step_ms, args.preset, args.mtp)
            name = "sync" if mode == "off" else "async"
            print(
                f"{n:>5} {name:>6} {r.steps:>6} {r.achieved_over_ideal:>15.2f} "
                f"{r.host_ms_per_step:>13.2f}"
            )


if __name__ == "__main__":
    main()
