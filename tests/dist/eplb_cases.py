"""EPLB weight moves on gloo ranks: weights coded by (layer, logical expert)."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

from dsv4_serving.eplb.algorithm import rebalance
from dsv4_serving.eplb.transfer import apply_moves, plan_moves

LAYERS, EXPERTS = 3, 8


def coded(layer: int, expert: int, shape: tuple[int, ...]) -> torch.Tensor:
    return (
        layer * 1000.0
        + expert * 10.0
        + torch.arange(float(torch.tensor(shape).prod())).view(shape) / 1e3
    )


def random_moves(rank: int, world: int, port: int, slots: int, rounds: int) -> list[dict[str, Any]]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        rng = random.Random(11)  # the same plans on every rank
        per = slots // world
        place = [
            [e for e in range(EXPERTS)] + [rng.randrange(EXPERTS) for _ in range(slots - EXPERTS)]
            for _ in range(LAYERS)
        ]
        w1 = {
            layer: torch.stack(
                [coded(layer, place[layer][s], (3, 4)) for s in range(rank * per, (rank + 1) * per)]
            )
            for layer in range(LAYERS)
        }
        w2 = {
            layer: torch.stack(
                [coded(layer, place[layer][s], (4, 2)) for s in range(rank * per, (rank + 1) * per)]
            )
            for layer in range(LAYERS)
        }
        report = []
        for _ in range(rounds):
            load = [[rng.paretovariate(1.2) for _ in range(EXPERTS)] for _ in range(LAYERS)]
            new = rebalance(load, slots, groups=1, nodes=1, ranks=world).phys_to_log
            moved = 0
            for layer in range(LAYERS):
                moves = plan_moves(place[layer], new[layer], world)
                moved += sum(m.src_slot // per != m.dst_slot // per for m in moves)
                w1[layer], w2[layer] = apply_moves(
                    [w1[layer], w2[layer]], moves, rank, list(range(world))
                )
                place[layer] = list(new[layer])
            wrong = [
                (layer, s)
                for layer in range(LAYERS)
                for i, s in enumerate(range(rank * per, (rank + 1) * per))
                if not torch.equal(w1[layer][i], coded(layer, place[layer][s], (3, 4)))
                or not torch.equal(w2[layer][i], coded(layer, place[layer][s], (4, 2)))
            ]
            report.append({"wrong": wrong, "remote_moves": moved})
        return report
    finally:
        dist.destroy_process_group()


# ---- the balancer on a real model: outputs and stacks across live re-placements -------------


def _build(preset: str, parallel: Any, quant: str) -> torch.nn.Module:
    import dataclasses

    from dsv4_serving.layers.quant.methods import cast_model
    from dsv4_serving.layers.quant.scheme import QuantScheme
    from dsv4_serving.loader.dummy import init_dummy_weights
    from dsv4_serving.models.registry import REGISTRY
    from dsv4_serving.presets.configs import preset_config

    cfg = preset_config(preset)
    cls = REGISTRY.resolve(cfg["architectures"][0])
    mcfg = cls.config_class.from_dict(cfg)
    if quant != "none":
        mcfg = dataclasses.replace(mcfg, quant=QuantScheme.of(quant))
    model = cast_model(cls(mcfg, parallel), torch.float32).eval()
    init_dummy_weights(model, 3)
    return model


def _prefill_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk

    block = 16
    nb = -(-max(len(p) for p in prompts) // block)
    cache = model.allocate_cache(nb * len(prompts), block, len(prompts))
    chunks = [
        SeqChunk(0, len(p), list(range(i * nb, (i + 1) * nb)), i) for i, p in enumerate(prompts)
    ]
    meta = AttentionMetadata.build(chunks, block)
    h = model(torch.tensor([t for p in prompts for t in p]), meta, cache)
    return model.compute_logits(h[meta.last_token_indices()])  # type: ignore[no-any-return]


def model_replacement(rank: int, world: int, port: int, quant: str, layout: str) -> dict[str, Any]:
    """DP 2 x EP 2 or TP 2 x EP 2 (exact combine), 2 redundant slots, a plan every 2 steps over
    skewed prompts: every step's logits against one process's, and afterwards every slot's
    stacked tensors (quantized weights and their scales) against its logical expert's. Under
    TP both ranks hold the same prompts and only TP rank 0 counts them."""
    from dsv4_serving.distributed.groups import ModelParallel
    from dsv4_serving.distributed.parallel_state import (
        destroy_distributed,
        get_world_group,
        init_distributed,
    )
    from dsv4_serving.distributed.topology import Topology
    from dsv4_serving.eplb.balancer import Balancer
    from dsv4_serving.layers.moe import Experts

    topo = Topology(dp=2, ep=2) if layout == "dp2" else Topology(tp=2, ep=2)
    init_distributed(topo, rank, master_addr="127.0.0.1", master_port=port)
    w = get_world_group()
    try:
        out: dict[str, Any] = {}
        for preset in ("dsv4-tiny", "dsv3-small"):
            split = {"dp": w} if layout == "dp2" else {"tp": w}
            par = ModelParallel(ep=w, exact_moe=True, eplb=True, redundant_experts=2, **split)
            ref, model = _build(preset, ModelParallel(), quant), _build(preset, par, quant)
            groups = int(getattr(model.config, "n_group", 1) or 1)
            bal = Balancer.for_model(model, par, interval=2, window=4, groups=groups)
            # each DP rank its own skewed prompts; TP ranks the same ones
            rng = random.Random(5 + (rank if layout == "dp2" else 0))
            prompts = [[rng.choice([5, 9, 5, 17]) for _ in range(n)] for n in (30, 12, 21)]
            with torch.inference_mode():
                want = _prefill_logits(ref, prompts)
                worst = 0.0
                for _ in range(9):
                    bal.begin(real=True)
                    got = _prefill_logits(model, prompts)
                    bal.end_step()
                    worst = max(worst, float((got - want).abs().max() / want.abs().max()))
            wrong = []
            moved_slots = 0
            for (name, m), (_, r) in zip(model.named_modules(), ref.named_modules(), strict=True):
                if not isinstance(m, Experts) or m.slot_map is None:
                    continue
                p2l = m.slot_map.phys_to_log.tolist()
                per = len(p2l) // world
                mine = p2l[rank * per : (rank + 1) * per]
                moved_slots += sum(e != s % m.num_experts for s, e in enumerate(p2l))
                for pname, p in m.named_parameters(recurse=False):
                    full = dict(r.named_parameters(recurse=False))[pname]
                    for i, e in enumerate(mine):
                        if not torch.equal(p[i], full[e]):
                            wrong.append(f"{name}.{pname}[{i}] != expert {e}")
            out[preset] = {
                "worst": worst,
                "wrong": wrong,
                "moved_slots": moved_slots,
                "rearrangements": bal.stats.rearrangements,
                "params": sorted(n for n, _ in model.layers[1].ffn.experts.named_parameters()),
            }
        return out
    finally:
        destroy_distributed()
