"""Prefill tokens/s and decode step latency of our models beside transformers' forward on the
same preset config, the same weights and the same inputs (CPU, float32).

    .venv/bin/python benchmarks/model_forward.py [--presets dsv4-tiny dsv3-small]
        [--batches 1 32] [--prompt 128] [--decode-steps 8] [--threads N]

The ratio (ours / transformers for throughput, transformers / ours for latency: > 1 means we
are faster) is the figure; absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.models.reference import transformers_reference
from dsv4_serving.models.registry import REGISTRY
from dsv4_serving.presets import preset_config

BLOCK = 128


def _ours(config: dict[str, Any]) -> Any:
    cls = REGISTRY.resolve(config["architectures"][0])
    model = cls(cls.config_class.from_dict(config)).float().eval()
    init_dummy_weights(model, seed=0)
    return model


def _time(fn: Any, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(preset: str, batch: int, prompt: int, steps: int, reps: int) -> dict[str, float]:
    config = preset_config(preset)
    ours = _ours(config)
    ref = transformers_reference(config, ours)
    ids = torch.randint(
        0, config["vocab_size"], (batch, prompt + steps), generator=torch.Generator().manual_seed(0)
    )
    nb = -(-(prompt + steps) // BLOCK)
    blocks = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]

    def ours_prefill() -> tuple[Any, Any]:
        cache = ours.allocate_cache(batch * nb, BLOCK, batch)
        chunks = [SeqChunk(0, prompt, blocks[i], i) for i in range(batch)]
        meta = AttentionMetadata.build(chunks, BLOCK)
        h = ours(ids[:, :prompt].reshape(-1), meta, cache)
        ours.compute_logits(h[meta.last_token_indices()])
        return cache, meta

    def ref_prefill() -> Any:
        return ref(ids[:, :prompt], use_cache=True, logits_to_keep=1)

    with torch.no_grad():
        t_ours_pf = _time(ours_prefill, reps)
        t_ref_pf = _time(ref_prefill, reps)

        cache, _ = ours_prefill()
        ours_steps = []
        for s in range(steps):
            chunks = [SeqChunk(prompt + s, 1, blocks[i], i) for i in range(batch)]
            meta = AttentionMetadata.build(chunks, BLOCK)
            t = time.perf_counter()
            ours.compute_logits(ours(ids[:, prompt + s], meta, cache))
            ours_steps.append(time.perf_counter() - t)
        out = ref_prefill()
        ref_cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        ref_steps = []
        for s in range(steps):
            t = time.perf_counter()
            ref(ids[:, prompt + s : prompt + s + 1], cache=ref_cache, use_cache=True)
            ref_steps.append(time.perf_counter() - t)
    return {
        "ours_prefill_tps": batch * prompt / t_ours_pf,
        "ref_prefill_tps": batch * prompt / t_ref_pf,
        "ours_decode_ms": 1000 * statistics.median(ours_steps),
        "ref_decode_ms": 1000 * statistics.median(ref_steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["dsv4-tiny", "dsv3-small"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"CPU float32, prompt {args.prompt} tokens, {args.decode_steps} decode steps, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    head = (
        f"{'model':<11} {'batch':>5} | {'prefill tok/s ours':>18} {'transformers':>12} "
        f"{'ratio':>6} | {'decode ms ours':>14} {'transformers':>12} {'ratio':>6}"
    )
    print(head)
    print("-" * len(head))
    for preset in args.presets:
        for batch in args.batches:
            r = bench(preset, batch, args.prompt, args.decode_steps, args.reps)
            print(
                f"{preset:<11} {batch:>5} | {r['ours_prefill_tps']:>18.0f} "
                f"{r['ref_prefill_tps']:>12.0f} {r['ours_prefill_tps'] / r['ref_prefill_tps']:>6.2f} | "
                f"{r['ours_decode_ms']:>14.1f} {r['ref_decode_ms']:>12.1f} "
                f"{r['ref_decode_ms'] / r['ours_decode_ms']:>6.2f}"
            )


if __name__ == "__main__":
    main()
