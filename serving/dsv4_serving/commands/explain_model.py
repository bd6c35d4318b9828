"""``dsv4 explain-model MODEL``: what the engine would pick for a checkpoint, and why.

In the seed's troubleshooting order: (1) which class the checkpoint's architecture resolves to
and who registered it, (2) which device and attention backend the platform picks and from
which config fields, (3) the derived switches and the KV cache shape, then (5) the parallel
plan for ``--tp/--dp/--ep``: which tensors each rank holds whole, TP-sharded or expert-local,
and the weight and KV bytes per rank, (5b) with ``--cp N`` the context-parallel plan of a 128K
and a 1M prompt (``distributed/cp_plan.py``): the split, what is gathered, and per CP rank the
rows, causal work, activation, gathered and KV bytes, (6) the memory plan: weight bytes per
rank by kind in the stored format (``--quantization``), KV per token and per 4K/32K/128K
sequence, and with ``--device-memory`` how many sequences fit (exit 1 when the weights alone
do not). Reads
``config.json`` only; no weights are loaded. The released models' shapes are built in
(``deepseek-v4-flash``, ``deepseek-v3``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from dsv4_serving.distributed.topology import Topology
from dsv4_serving.layers.quant.scheme import QuantScheme, scheme_from_checkpoint, scheme_from_config
from dsv4_serving.models.config import architecture_of, read_config_json
from dsv4_serving.models.memory_plan import MemoryPlan, memory_plan, parse_bytes, render_memory
from dsv4_serving.presets.configs import PRESETS, SHAPES, preset_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default="dsv4-tiny",
        help="checkpoint directory, config.json, preset or released shape "
        f"({', '.join(sorted(PRESETS) + sorted(SHAPES))})",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="cpu | cuda | npu | auto (default: auto, npu > cuda > cpu; env DSV4_DEVICE)",
    )
    parser.add_argument("--block-size", type=int, default=128, help="KV block size in tokens")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--dp", type=int, default=1, help="data parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (1 or tp x dp)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes the ranks spread over")
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context parallel size: print the CP plan of a 128K and a 1M prompt",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "fp8", "fp4", "w8a8"],
        help="weight format to plan for (default: the checkpoint's; none = bf16)",
    )
    parser.add_argument(
        "--device-memory", default=None, help="memory of one device, e.g. 64GiB (910B), 80GB"
    )
    parser.add_argument(
        "--memory-utilization",
        type=float,
        default=0.9,
        help="fraction of device memory for weights + KV (the engine's gpu_memory_utilization)",
    )


def load_model_config(model: str) -> tuple[dict[str, Any], str]:
    if model in PRESETS:
        return preset_config(model), f"preset {model}"
    if model in SHAPES:
        return dict(SHAPES[model]), f"{model} (built-in config.json fields, no weights)"
    return read_config_json(model), str(Path(model))


def _scheme(config: dict[str, Any], source: str, quantization: str) -> QuantScheme:
    found = scheme_from_config(config)
    if quantization == "auto":
        ckpt = Path(source)
        if ckpt.is_dir() or ckpt.is_file():
            return scheme_from_checkpoint(config, ckpt if ckpt.is_dir() else ckpt.parent)
        return found
    return QuantScheme.of(quantization, found.block)  # type: ignore[arg-type]


def explain(
    config: dict[str, Any],
    source: str,
    device: str,
    block_size: int,
    topology: Topology | None = None,
    quantization: str = "auto",
    device_bytes: int | None = None,
    utilization: float = 0.9,
    cp: int = 1,
) -> str:
    return _explain(
        config, source, device, block_size, topology, quantization, device_bytes, utilization, cp
    )[0]


def _explain(
    config: dict[str, Any],
    source: str,
    device: str,
    block_size: int,
    topology: Topology | None,
    quantization: str,
    device_bytes: int | None,
    utilization: float,
    cp: int = 1,
) -> tuple[str, MemoryPlan | None]:
    from dsv4_serving.models.parallel_plan import parallel_plan, render
    from dsv4_serving.models.registry import REGISTRY
    from dsv4_serving.platform.backend import select_attention_backend
    from dsv4_serving.platform.device import detect_platform

    lines = [f"model: {source}"]
    arch = architecture_of(config)
    reg = REGISTRY.registration(arch)
    cls = REGISTRY.resolve(arch)
    lines += [
        "1. architecture",
        f"   {arch} -> {reg.target} (registered by {reg.source})",
        f"   class {cls.__module__}.{cls.__qualname__} imports",
    ]
    platform = detect_platform(device)
    choice = select_attention_backend(config, platform.name)
    lines += [
        "2. platform and attention backend",
        f"   device: {platform.name} ({platform.reason}); collectives: {platform.dist_backend}",
        f"   attention backend: {choice.name}",
        f"   because: {choice.reason}",
        f"   kv cache: {choice.kv_cache_kind}",
        "   implementations (the engine runs the first that can run here): "
        + (", ".join(choice.implementations) or "none"),
        "3. derived switches",
    ]
    lines += [f"   {k} = {str(v).lower()}" for k, v in choice.switches.items()]
    scheme = _scheme(config, source, quantization)
    cfg = dataclasses.replace(cls.config_class.from_dict(config), quant=scheme)
    weights = "bf16" if scheme.name == "none" else f"{scheme.name} + bf16"
    lines += _layers(cfg, block_size)
    topo = topology or Topology()
    plan = parallel_plan(cls, cfg, topo)
    lines += render(plan, _kv_bytes_per_block(cfg, block_size), block_size, weights)
    if cp > 1:
        lines += _cp_lines(cfg, cp, block_size)
    if hasattr(cfg, "compress_ratios") and (
        block_size % cfg.csa_ratio or block_size % cfg.hca_ratio
    ):
        return "\n".join(lines), None
    mp = memory_plan(cls, cfg, topo, block_size, device_bytes, utilization)
    lines += render_memory(mp, weights, utilization)
    return "\n".join(lines), mp


def _kv_bytes_per_block(cfg: Any, block_size: int) -> int | None:
    if hasattr(cfg, "compress_ratios"):
        if block_size % cfg.csa_ratio or block_size % cfg.hca_ratio:
            return None
        from dsv4_serving.attention.kv_cache.v4 import V4KVCache

        return int(V4KVCache.bytes_per_block(cfg, block_size, 2))
    from dsv4_serving.attention.kv_cache.mla import MLAKVCache

    return int(MLAKVCache.bytes_per_block(cfg, block_size, 2))


CP_PROMPTS = (131072, 1 << 20)


def _cp_lines(cfg: Any, cp: int, block_size: int) -> list[str]:
    """The CP plan of a 128K and a 1M prompt, each prefilled as one chunk."""
    from dsv4_serving.attention.v4 import SLICE_BYTES
    from dsv4_serving.distributed.cp_plan import (
        GATHERED,
        GATHERED_MLA,
        SPLIT_BY_SEQUENCE,
        SPLIT_BY_SEQUENCE_MLA,
        CPModel,
        CPPlan,
    )

    v4 = hasattr(cfg, "compress_ratios")
    model = CPModel.v4(cfg) if v4 else CPModel.mla(cfg)
    per_block = _kv_bytes_per_block(cfg, block_size) or 0
    per_seq = 0
    if v4 and per_block:
        from dsv4_serving.attention.kv_cache.v4 import V4KVCache

        per_seq = V4KVCache.bytes_per_slot(cfg, 2)
    out = [
        f"5b. context parallel (--cp {cp}), bf16: each chunk in 2 x {cp} parts of whole "
        f"{block_size}-token blocks, rank r owns parts r and {2 * cp - 1}-r (zig-zag); the "
        "cache inputs are all-gathered per layer and every rank writes the same cache, so "
        "decode stays non-CP",
        "   split by sequence: " + "; ".join(SPLIT_BY_SEQUENCE if v4 else SPLIT_BY_SEQUENCE_MLA),
        "   all-gathered: " + "; ".join(GATHERED if v4 else GATHERED_MLA),
    ]
    for tokens in CP_PROMPTS:
        plan = CPPlan.build(model, tokens, cp, block_size, 0, per_block, per_seq)
        over = tokens > cfg.max_position_embeddings
        out.append(
            f"   {tokens}-token prompt as one chunk"
            + (f" (beyond max_position_embeddings {cfg.max_position_embeddings})" if over else "")
            + f": work imbalance {plan.imbalance():.4f}; gathered inputs of the largest "
            f"layer {_gib(plan.gathered_buffer_bytes())}; KV {_gib(plan.kv_bytes)} per rank "
            "(replicated)"
        )
        for r in plan.ranks:
            where = ", ".join(f"{a}-{b - 1}" for a, b in r.spans)
            idx = ""
            if r.indexer_bytes:
                idx = (
                    f", indexer scores {_gib(r.indexer_bytes)} in one pass "
                    f"(<= {_gib(min(r.indexer_bytes, SLICE_BYTES))} per slice)"
                )
            out.append(
                f"     rank {r.rank}: {r.rows} rows (positions {where}), "
                f"{100 * r.key_visits / max(1, sum(x.key_visits for x in plan.ranks)):.1f}% "
                f"of the key visits; residual {_gib(r.residual_bytes)}{idx}; receives "
                f"{_gib(plan.gathered_bytes(r.rank))} over {len(model.layers)} layers"
            )
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _layers(cfg: Any, block_size: int) -> list[str]:
    out = ["4. layers"]
    if hasattr(cfg, "compress_ratios"):
        n = cfg.num_hidden_layers
        kinds = [
            "window" if r == 0 else f"CSA/{r}" if r == cfg.csa_ratio else f"HCA/{r}"
            for r in cfg.compress_ratios[:n]
        ]
        out.append(f"   {n} layers: {', '.join(kinds)}; window {cfg.sliding_window} tokens")
        out.append(
            f"   MoE: {cfg.num_hash_layers} hash-routed, {n - cfg.num_hash_layers} "
            f"{cfg.scoring_func}-routed; {cfg.n_routed_experts} experts, top "
            f"{cfg.num_experts_per_tok}; mHC {cfg.hc_mult} streams; "
            f"MTP layers: {cfg.num_nextn_predict_layers}"
        )
        if block_size % cfg.csa_ratio or block_size % cfg.hca_ratio:
            out.append(f"   block size {block_size} is not a multiple of the compression ratios")
        else:
            from dsv4_serving.attention.kv_cache.v4 import V4KVCache

            per_block = V4KVCache.bytes_per_block(cfg, block_size, 2)
            per_slot = V4KVCache.bytes_per_slot(cfg, 2)
            out.append(
                f"   kv bytes (bf16): {per_block} per {block_size}-token block, "
                f"{per_slot} per sequence (window + compressor state)"
            )
    else:
        dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
        out.append(
            f"   {cfg.num_hidden_layers} layers: {dense} dense, "
            f"{cfg.num_hidden_layers - dense} MoE ({cfg.n_routed_experts} experts, top "
            f"{cfg.num_experts_per_tok}, {cfg.n_group} groups keep {cfg.topk_group}); "
            f"MTP layers: {cfg.num_nextn_predict_layers}"
        )
        from dsv4_serving.attention.kv_cache.mla import MLAKVCache

        out.append(
            f"   kv bytes (bf16): {MLAKVCache.bytes_per_block(cfg, block_size, 2)} per "
            f"{block_size}-token block"
        )
    return out


def run(args: argparse.Namespace) -> int:
    from dsv4_serving.models.registry import UnknownArchitectureError
    from dsv4_serving.platform.device import PlatformError

    try:
        config, source = load_model_config(args.model)
        topology = Topology(args.tp, args.dp, args.ep, args.nnodes)
        if args.cp < 1:
            raise ValueError(f"--cp must be >= 1, got {args.cp}")
        device_bytes = None if args.device_memory is None else parse_bytes(args.device_memory)
        text, mp = _explain(
            config,
            source,
            args.device,
            args.block_size,
            topology,
            args.quantization,
            device_bytes,
            args.memory_utilization,
            args.cp,
        )
        print(text)
        if mp is not None and not mp.weights_fit:
            print(
                f"dsv4 explain-model: the weights alone do not fit: "
                f"{mp.plan.weight_bytes_per_rank / 2**30:.1f} GiB per rank > "
                f"{(mp.budget_bytes or 0) / 2**30:.1f} GiB ({args.device_memory} x "
                f"{args.memory_utilization}); add ranks (--ep/--tp/--dp) or quantize "
                "(--quantization w8a8 / fp8 / fp4)",
                file=sys.stderr,
            )
            return 1
    except (FileNotFoundError, ValueError, KeyError, ImportError, PlatformError) as exc:
        if isinstance(exc, UnknownArchitectureError):
            print(f"dsv4 explain-model: 1. architecture: {exc}", file=sys.stderr)
        else:
            print(f"dsv4 explain-model: {exc}", file=sys.stderr)
        return 1
    return 0
