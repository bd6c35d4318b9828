"""The parallel plan of a model: which tensors a rank holds whole, TP-sharded or expert-local,
and the weight and KV bytes per rank (``dsv4 explain-model --tp --dp --ep``).

Computed from the real classes built on the meta device (no memory, no weights), so the plan
is what the loader will fill, never a second description of the sharding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.distributed.topology import Topology
from dsv4_serving.layers.shard import shard_specs

Kind = Literal["tp", "ep", "replicated"]
# what a weight is for (the memory plan's rows)
WEIGHT_KINDS = ("attention", "dense", "experts", "embeddings", "other")


def weight_kind(name: str) -> str:
    if ".ffn.experts." in name:
        return "experts"
    if ".attn." in name:
        return "attention"
    if ".ffn." in name:
        return "dense"  # dense MLPs, shared experts, routers
    if name.startswith(("embed.", "head.")):
        return "embeddings"
    return "other"  # norms, mHC mixes, MTP input projections


@dataclass(frozen=True, slots=True)
class TensorPlan:
    pattern: str  # parameter name with layer indices as ``*``
    kind: Kind
    logical: tuple[int, ...]
    local: tuple[int, ...]
    count: int  # tensors matching the pattern


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    topology: Topology
    tensors: tuple[TensorPlan, ...]
    weight_bytes_per_rank: int
    weight_bytes_total: int  # one whole copy of the model
    bytes_by_kind: dict[str, int]  # this rank's weight bytes per ``WEIGHT_KINDS`` entry


def _rank0_parallel(topo: Topology) -> ModelParallel:
    def g(n: int) -> Group:
        return Group(tuple(range(n)), 0)

    return ModelParallel(tp=g(topo.tp), dp=g(topo.dp), ep=g(topo.ep))


def parallel_plan(model_cls: Any, cfg: Any, topo: Topology, dtype_bytes: int = 2) -> ParallelPlan:
    """Rank 0's share (even splits: every rank holds the same sizes); floating-point weights
    counted at ``dtype_bytes``, quantized weights, their scales and integer buffers
    (hash-routing tables) at their stored size (``cfg.quant`` picks the format)."""
    topo.check_model(cfg)
    with torch.device("meta"):
        part = model_cls(cfg, _rank0_parallel(topo))
    specs = shard_specs(part)
    stored = {
        f"{prefix}.{n}" if prefix else n
        for prefix, module in part.named_modules()
        for n in getattr(module, "quant_params", ())
    }
    rows: dict[str, list[Any]] = {}
    local_bytes = total_bytes = 0
    by_kind = dict.fromkeys(WEIGHT_KINDS, 0)
    for name, t in list(part.named_parameters()) + list(part.named_buffers()):
        plain = t.is_floating_point() and name not in stored
        size = dtype_bytes if plain else t.element_size()
        spec = specs.get(name)
        logical = tuple(t.shape) if spec is None else spec.logical_shape(t.shape)
        kind: Kind = "replicated"
        if spec is not None:
            kind = "ep" if topo.ep > 1 and ".experts." in name else "tp"
        local_bytes += t.numel() * size
        by_kind[weight_kind(name)] += t.numel() * size
        total_bytes += _numel(logical) * size
        pattern = re.sub(r"(layers|mtp)\.\d+\.", r"\1.*.", name)
        row = rows.setdefault(pattern, [kind, logical, tuple(t.shape), 0])
        row[3] += 1
    tensors = tuple(TensorPlan(p, *row) for p, row in rows.items())
    return ParallelPlan(topo, tensors, local_bytes, total_bytes, by_kind)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def render(
    plan: ParallelPlan, kv_bytes_per_block: int | None, block_size: int, weights: str = "bf16"
) -> list[str]:
    t = plan.topology
    out = [
        f"5. parallel plan: tp {t.tp} x dp {t.dp} = {t.world} ranks "
        f"(rank = dp_rank * {t.tp} + tp_rank), ep {t.ep}, {t.nnodes} node(s)"
    ]
    labels = {"tp": "TP-sharded", "ep": "expert-local", "replicated": "replicated"}
    for kind in ("tp", "ep"):
        mine = [p for p in plan.tensors if p.kind == kind]
        if mine:
            out.append(f"   {labels[kind]}:")
        for p in mine:
            shape = "x".join(map(str, p.logical))
            times = f" (x{p.count})" if p.count > 1 else ""
            out.append(f"     {p.pattern} [{shape} -> {'x'.join(map(str, p.local))}]{times}")
    # whole on every rank: names only (norms, routers, mHC, the shared KV head, compressors)
    names = [p.pattern for p in plan.tensors if p.kind == "replicated"]
    out.append(f"   replicated ({len(names)} kinds):")
    line = "    "
    for n in names:
        if len(line) + len(n) > 96:
            out.append(line.rstrip(","))
            line = "    "
        line += f" {n},"
    out.append(line.rstrip(","))
    out.append(
        f"   weight bytes ({weights}) per rank: {plan.weight_bytes_per_rank} "
        f"(whole model {plan.weight_bytes_total})"
    )
    if kv_bytes_per_block is not None:
        out.append(
            f"   kv bytes (bf16) per rank: {kv_bytes_per_block} per {block_size}-token block "
            "(the cache is replicated over TP; each DP rank holds its own sequences)"
        )
    return out
