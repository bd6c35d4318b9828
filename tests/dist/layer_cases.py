"""Layer checks on 2 ranks: every split layer against its unsplit version (same dummy seed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dsv4_serving.attention.kv_cache.mla import MLAKVCache
from dsv4_serving.attention.kv_cache.v4 import V4KVCache
from dsv4_serving.attention.mla import MLAttention
from dsv4_serving.attention.selector import attention_backend
from dsv4_serving.attention.v4 import V4Attention
from dsv4_serving.distributed.comm import all_gather
from dsv4_serving.distributed.groups import ModelParallel
from dsv4_serving.distributed.parallel_state import destroy_distributed, get_world_group
from dsv4_serving.distributed.topology import Topology
from dsv4_serving.layers.linear import ColumnParallelLinear, RowParallelLinear
from dsv4_serving.layers.moe import SwiGLU, V3MoE, V4MoE
from dsv4_serving.layers.rope import Rotary
from dsv4_serving.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.models.config import DeepseekV3Config, DeepseekV4Config
from dsv4_serving.presets.configs import preset_config

from .cases import BLOCK, _meta, join, world_variants

V4 = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))
V3 = DeepseekV3Config.from_dict(preset_config("dsv3-small"))
# the layers take the step's plan from their attention backend (what the models pass them)
V4_BACKEND: Any = attention_backend(V4, "cpu")
V3_BACKEND: Any = attention_backend(V3, "cpu")


def _pair(make: Callable[[ModelParallel], nn.Module], parallel: ModelParallel) -> tuple[Any, Any]:
    full, part = make(ModelParallel()), make(parallel)
    for m in (full, part):
        init_dummy_weights(m, seed=11)
    return full.eval(), part.eval()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _linears(tp: ModelParallel, x: torch.Tensor) -> dict[str, float]:
    g = tp.tp
    out = {}
    full, col = _pair(lambda p: ColumnParallelLinear(128, 96, p.tp), tp)
    out["column"] = _diff(all_gather(col(x), g), full(x))
    full, row = _pair(lambda p: RowParallelLinear(128, 96, p.tp), tp)
    part_x = x.narrow(1, g.index * 64, 64)
    out["row"] = _diff(row(part_x), full(x))
    full, swi = _pair(lambda p: SwiGLU(128, 64, 10.0, p.tp), tp)
    out["swiglu"] = _diff(swi(x), full(x))
    ids = torch.tensor([0, 5, 131, 132, 263, 7])
    full, emb = _pair(lambda p: VocabParallelEmbedding(264, 128, p.tp), tp)
    out["embedding_equal"] = float(not torch.equal(emb(ids), full(ids)))
    full, head = _pair(lambda p: ParallelLMHead(128, 264, p.tp), tp)
    out["lm_head"] = _diff(head(x), full(x))
    return out


def _attention(tp: ModelParallel) -> dict[str, float]:
    out = {}
    g = torch.Generator().manual_seed(1)
    x_pre = torch.randn(50, V4.hidden_size, generator=g)
    x_dec = torch.randn(2, V4.hidden_size, generator=g)
    rot = (Rotary(V4.main_rope), Rotary(V4.compress_rope))
    for layer in (0, 1, 2):  # window, CSA (indexer), HCA
        full, part = _pair(lambda p, i=layer: V4Attention(V4, i, *rot, p.tp), tp)
        ys = []
        for m in (full, part):
            cache = V4KVCache.allocate(V4, 8, BLOCK, 2).layers[layer]
            y1 = m(x_pre, V4_BACKEND.plan(_meta([0, 0], [30, 20], 4), BLOCK), cache)
            y2 = m(x_dec, V4_BACKEND.plan(_meta([30, 20], [1, 1], 4), BLOCK), cache)
            ys.append(torch.cat((y1, y2)))
        out[f"v4_attention_layer{layer}"] = _diff(ys[1], ys[0])
    x3 = torch.randn(40, V3.hidden_size, generator=g)
    full, part = _pair(lambda p: MLAttention(V3, Rotary(V3.rope), p.tp), tp)
    ys = []
    for m in (full, part):
        cache = MLAKVCache.allocate(V3, 8, BLOCK, 2, "cpu", torch.float32).latent[1]
        y1 = m(x3[:38], V3_BACKEND.plan(_meta([0, 0], [25, 13], 4), BLOCK), cache)
        y2 = m(x3[38:], V3_BACKEND.plan(_meta([25, 13], [1, 1], 4), BLOCK), cache)
        ys.append(torch.cat((y1, y2)))
    out["mla"] = _diff(ys[1], ys[0])
    return out


def _moe(kind: str) -> dict[str, float]:
    """Whole MoE vs single (relative diff), and its routed part's bitwise check (1 = differs)."""
    par = world_variants(kind)
    g = torch.Generator().manual_seed(2)
    x_all = torch.randn(9, V4.hidden_size, generator=g)
    ids_all = torch.randint(0, V4.vocab_size, (9,), generator=g)
    # DP ranks hold different tokens (uneven: 5 and 4), TP ranks the same ones
    mine = slice(0, 5) if par.dp.index == 0 else slice(5, 9)
    if par.dp.size == 1:
        mine = slice(0, 9)
    out = {}
    makers: dict[str, Callable[[ModelParallel], nn.Module]] = {
        "v4moe": lambda p: V4MoE(
            V4.hidden_size, 64, 8, 2, V4.vocab_size, True, "sqrtsoftplus", 1.5, 10.0, 1, p
        ),
        "v4moe_scored": lambda p: V4MoE(
            V4.hidden_size, 64, 8, 2, V4.vocab_size, False, "sqrtsoftplus", 1.5, 10.0, 1, p
        ),
        "v3moe": lambda p: V3MoE(V4.hidden_size, 64, 8, 2, 2, 1, True, 2.5, 1, p),
    }
    for name, make in makers.items():
        full, part = _pair(make, par)
        v3 = name == "v3moe"
        args_all = (x_all,) if v3 else (x_all, ids_all)
        args = (x_all[mine],) if v3 else (x_all[mine], ids_all[mine])
        out[f"{name}/{kind}"] = _diff(part(*args), full(*args_all)[mine])
        # the same router outputs on both sides (a router on 5 rows may round differently
        # from one on 9): the check is that splitting the experts changes no bit
        d = part.comm.dispatch(x_all[mine], *part.gate(*args))
        routed = part.experts.per_choice(d.x, d.idx, d.weights)
        got = part.comm.combine(routed, torch.zeros_like(args[0]), d)
        want = full.experts(d.x, d.idx, d.weights)
        if par.dp.size > 1:
            want = want[mine]
        out[f"{name}/{kind}/routed_bitwise_differs"] = float(not torch.equal(got, want))
    return out


def layers_world2(rank: int, world: int, port: int) -> dict[str, float]:
    join(rank, port, Topology(tp=2, ep=2))
    try:
        tp = ModelParallel(tp=get_world_group())
        x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
        out = _linears(tp, x) | _attention(tp)
        for kind in ("tp2", "tp2-ep2", "tp2-ep2-exact", "dp2-ep2", "dp2-ep2-exact"):
            out |= _moe(kind)
        return out
    finally:
        destroy_distributed()
