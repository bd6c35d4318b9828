"""The memory plan of a parallel layout (``dsv4 explain-model --device-memory``): weight bytes
per rank by kind, KV bytes per token and per sequence, and how many sequences of a length fit
beside the weights. Weights come from the parallel plan (the real classes on the meta device,
in the stored format the quantization picks), KV from the cache classes' own sizing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dsv4_serving.distributed.topology import Topology
from dsv4_serving.models.parallel_plan import WEIGHT_KINDS, ParallelPlan, parallel_plan

SEQ_LENS = (4096, 32768, 131072)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``64GiB``, ``80GB``, ``512Mi``, ``1e9`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kmgtKMGT]i?)?[bB]?\s*", text)
    if m is None:
        raise ValueError(f"{text!r} is not a size (e.g. 64GiB, 80GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    plan: ParallelPlan
    kv_bytes_per_token: float  # paged, per rank (replicated over TP)
    kv_bytes_per_seq: dict[int, int]  # length -> bytes, paged + fixed per-sequence state
    device_bytes: int | None
    budget_bytes: int | None  # device_bytes x utilization
    seqs_per_rank: dict[int, int]  # length -> sequences that fit beside the weights

    @property
    def weights_fit(self) -> bool:
        return self.budget_bytes is None or self.plan.weight_bytes_per_rank <= self.budget_bytes


def memory_plan(
    model_cls: Any,
    cfg: Any,
    topo: Topology,
    block_size: int,
    device_bytes: int | None = None,
    utilization: float = 0.9,
    dtype_bytes: int = 2,
) -> MemoryPlan:
    plan = parallel_plan(model_cls, cfg, topo, dtype_bytes)
    cache = model_cls.cache_class
    per_block = int(cache.bytes_per_block(cfg, block_size, dtype_bytes))
    fixed = int(cache.bytes_per_slot(cfg, dtype_bytes))
    per_seq = {n: -(-n // block_size) * per_block + fixed for n in SEQ_LENS}
    budget = None if device_bytes is None else int(device_bytes * utilization)
    fits: dict[int, int] = {}
    if budget is not None:
        free = max(0, budget - plan.weight_bytes_per_rank)
        fits = {n: free // b for n, b in per_seq.items()}
    return MemoryPlan(plan, per_block / block_size, per_seq, device_bytes, budget, fits)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def render_memory(mp: MemoryPlan, weights: str, utilization: float) -> list[str]:
    t = mp.plan.topology
    out = [f"6. memory plan per rank ({weights} weights, bf16 KV)"]
    for kind in WEIGHT_KINDS:
        out.append(f"   weights {kind:<11} {_gib(mp.plan.bytes_by_kind[kind]):>12}")
    out.append(f"   weights total      {_gib(mp.plan.weight_bytes_per_rank):>12}")
    out.append(
        f"   kv per token: {mp.kv_bytes_per_token:.0f} bytes (replicated over TP {t.tp}; "
        f"each of DP {t.dp} holds its own sequences)"
    )
    for n, b in mp.kv_bytes_per_seq.items():
        out.append(f"   kv per {n // 1024}K sequence: {_gib(b)}")
    if mp.device_bytes is None:
        return out
    out.append(
        f"   device {_gib(mp.device_bytes)} x {utilization} = {_gib(mp.budget_bytes or 0)} "
        f"budget; left for KV after weights: "
        f"{_gib(max(0, (mp.budget_bytes or 0) - mp.plan.weight_bytes_per_rank))}"
    )
    if not mp.weights_fit:
        out.append("   does NOT fit: the weights alone exceed the budget")
        return out
    for n, k in mp.seqs_per_rank.items():
        out.append(f"   {n // 1024}K sequences at once: {k} per DP rank, {k * t.dp} per engine")
    return out
