"""Decode step time and tokens/s with weights held in float32 / bfloat16, fp8 (128x128 block
scales) and W8A8 int8, on the same model config and the same (dummy) weights quantized
(CPU). The goal: W8A8 decode >= 1.0x the float32 path's tokens/s.

    .venv/bin/python benchmarks/quantized.py [--configs dsv3-small dsv3-anchor]
        [--formats float32 bfloat16 fp8 fp8-torch w8a8 w8a8-torch w8a8-avx2]
        [--batches 1 16] [--prompt 64]
        [--decode-steps 8] [--repeats 1] [--threads N]

``dsv3-anchor`` is the engine comparison's model (a config-only shape in ``presets/configs.py``).
Each decode step runs ``batch`` sequences one token each after a ``--prompt``-token prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.kernels.fp8 import Fp8Kernel
from dsv4_serving.kernels.w8a8 import W8A8Kernel
from dsv4_serving.layers.quant.methods import W8A8, Fp8Block, cast_model
from dsv4_serving.layers.quant.scheme import QuantScheme
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.models.registry import REGISTRY
from dsv4_serving.presets.configs import SHAPES, preset_config, shape_config

BLOCK = 64
FORMATS = {
    "float32": ("none", torch.float32),
    "bfloat16": ("none", torch.bfloat16),
    "fp8": ("fp8", torch.float32),
    "fp8-torch": ("fp8", torch.float32),  # the pure-torch fp8 path (no C++ kernel)
    "w8a8": ("w8a8", torch.float32),
    "w8a8-torch": ("w8a8", torch.float32),  # the pure-torch W8A8 path (no C++ kernel)
    "w8a8-avx2": ("w8a8", torch.float32),  # the kernel's AVX2 build (where AVX-512 VNNI is)
}


def _config(name: str) -> dict[str, Any]:
    return shape_config(name) if name in SHAPES else preset_config(name)


def _model(config: dict[str, Any], fmt: str) -> Any:
    scheme, dtype = FORMATS[fmt]
    cls = REGISTRY.resolve(config["architectures"][0])
    cfg = dataclasses.replace(cls.config_class.from_dict(config), quant=QuantScheme.of(scheme))  # type: ignore[arg-type]
    model = cls(cfg)
    init_dummy_weights(model, seed=0)  # the float weights, quantized whole for fp8 / w8a8
    if fmt == "fp8-torch":
        for m in model.modules():
            if isinstance(getattr(m, "quant", None), Fp8Block):
                m.quant.kernel = Fp8Kernel(use_kernel=False)
    if fmt in ("w8a8-torch", "w8a8-avx2"):
        kernel = W8A8Kernel(False) if fmt == "w8a8-torch" else W8A8Kernel(True, "avx2")
        for m in model.modules():
            if isinstance(getattr(m, "quant", None), W8A8):
                m.quant.kernel = kernel
    return cast_model(model, dtype).eval()


def weight_bytes(model: Any) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def bench(
    config: dict[str, Any], fmt: str, batch: int, prompt: int, steps: int, clock: Any = None
) -> dict[str, float]:
    clock = clock or time.perf_counter
    model = _model(config, fmt)
    ids = torch.randint(
        0,
        int(config["vocab_size"]),
        (batch, prompt + steps + 1),
        generator=torch.Generator().manual_seed(0),
    )
    nb = -(-(prompt + steps + 1) // BLOCK)
    blocks = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    cache = model.allocate_cache(batch * nb, BLOCK, batch)
    times = []
    with torch.inference_mode():
        meta = AttentionMetadata.build(
            [SeqChunk(0, prompt, blocks[i], i) for i in range(batch)], BLOCK
        )
        model.compute_logits(
            model(ids[:, :prompt].reshape(-1), meta, cache)[meta.last_token_indices()]
        )
        for s in range(steps + 1):  # the first step warms up
            chunks = [SeqChunk(prompt + s, 1, blocks[i], i) for i in range(batch)]
            meta = AttentionMetadata.build(chunks, BLOCK)
            t = clock()
            model.compute_logits(model(ids[:, prompt + s], meta, cache))
            times.append(clock() - t)
    step = statistics.median(times[1:])
    return {"step_ms": 1000 * step, "tok_s": batch / step, "mib": weight_bytes(model) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["dsv3-small", "dsv3-anchor"])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every format, alternating; the median of each format's runs is reported",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (steadier on a shared machine; use with --threads 1)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"CPU decode, prompt {args.prompt}, {args.decode_steps} steps (median), "
        f"{args.repeats} alternating run(s) per format (median), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock"
    )
    head = (
        f"{'config':<11} {'batch':>5} {'weights':>9} {'MiB':>8} {'step ms':>9} {'tok/s':>9} "
        f"{'vs float32':>10}"
    )
    print(head)
    print("-" * len(head))
    for name in args.configs:
        config = _config(name)
        for batch in args.batches:
            # Formats alternate within each repeat, so a slow spell of the machine hits all alike.
            runs: dict[str, list[dict[str, float]]] = {fmt: [] for fmt in args.formats}
            for _ in range(max(1, args.repeats)):
                for fmt in args.formats:
                    runs[fmt].append(
                        bench(config, fmt, batch, args.prompt, args.decode_steps, clock)
                    )
            base = None
            for fmt in args.formats:
                step_ms = statistics.median(r["step_ms"] for r in runs[fmt])
                r = {
                    "step_ms": step_ms,
                    "tok_s": 1000 * batch / step_ms,
                    "mib": runs[fmt][0]["mib"],
                }
                base = r["tok_s"] if fmt == "float32" else base
                ratio = f"{r['tok_s'] / base:.2f}x" if base else "-"
                print(
                    f"{name:<11} {batch:>5} {fmt:>9} {r['mib']:>8.1f} {r['step_ms']:>9.2f} "
                    f"{r['tok_s']:>9.1f} {ratio:>10}"
                )


if __name__ == "__main__":
    main()
