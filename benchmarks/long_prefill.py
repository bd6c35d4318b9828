"""Peak memory and time of one long prompt's prefill on the long-context tiny V4 (CPU, float32).

    .venv/bin/python benchmarks/long_prefill.py [--preset dsv4-tiny-long]
        [--sizes 8192 16384 32768 65536] [--chunk 0] [--slice-mib 256] [--unsplit-up-to 0]

Each size runs in its own process (peak RSS is per process): the prompt is prefilled in one
step (``--chunk 0``) or in chunks of ``--chunk`` tokens, then the greedy next token is taken.
Reported per size: prefill seconds, tokens/s, the process's peak RSS and its growth over the
loaded model (the prefill's own peak), and the greedy token. ``--slice-mib`` bounds a V4
layer's query-side buffers (``attention/v4.py:SLICE_BYTES``); ``--unsplit-up-to N`` also runs
sizes <= N with one slice over the whole prompt and checks that the greedy token is the same
(the unsplit path's O(rows x entries) buffers need tens of GiB past ~16K tokens).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

BLOCK = 128


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one(preset: str, tokens: int, chunk: int, slice_mib: float) -> dict[str, Any]:
    """Prefill one ``tokens``-long prompt in this process and measure it."""
    import torch

    import dsv4_serving.attention.v4 as v4a
    from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
    from dsv4_serving.loader.dummy import init_dummy_weights
    from dsv4_serving.models.registry import REGISTRY
    from dsv4_serving.presets import preset_config

    v4a.SLICE_BYTES = int(slice_mib * (1 << 20))
    config = preset_config(preset)
    cls = REGISTRY.resolve(config["architectures"][0])
    model = cls(cls.config_class.from_dict(config)).float().eval()
    init_dummy_weights(model, seed=0)
    ids = torch.randint(
        0, config["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(0)
    )
    nb = -(-tokens // BLOCK)
    cache = model.allocate_cache(nb, BLOCK, 1)
    base = _rss_mib()
    step = chunk or tokens
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, tokens, step):
            n = min(step, tokens - start)
            meta = AttentionMetadata.build([SeqChunk(start, n, list(range(nb)), 0)], BLOCK)
            hidden = model(ids[start : start + n], meta, cache)
        logits = model.compute_logits(hidden[meta.last_token_indices()])
    seconds = time.perf_counter() - t0
    peak = _rss_mib()
    return {
        "tokens": tokens,
        "chunk": step,
        "slice_mib": slice_mib,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1),
        "peak_rss_mib": round(peak, 1),
        "prefill_peak_mib": round(peak - base, 1),
        "greedy_token": int(logits[-1].argmax()),
    }


def _child(args: argparse.Namespace, tokens: int, slice_mib: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        str(tokens),
        "--preset",
        args.preset,
        "--chunk",
        str(args.chunk),
        "--slice-mib",
        str(slice_mib),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="dsv4-tiny-long")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--chunk", type=int, default=0, help="tokens per prefill step (0: one step)")
    p.add_argument("--slice-mib", type=float, default=256.0, help="query-side buffer bound")
    p.add_argument("--unsplit-up-to", type=int, default=0, help="also run these unsplit")
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.preset, args.one, args.chunk, args.slice_mib)))
        return
    for tokens in args.sizes:
        row = _child(args, tokens, args.slice_mib)
        if tokens <= args.unsplit_up_to:
            whole = _child(args, tokens, 1 << 30)  # one slice: the whole prompt
            row["unsplit_peak_rss_mib"] = whole["peak_rss_mib"]
            row["unsplit_seconds"] = whole["seconds"]
            row["same_greedy_token"] = whole["greedy_token"] == row["greedy_token"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
