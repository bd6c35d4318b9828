"""EPLB's physical expert slots in the model, one process: each EP rank's slots hold their
logical experts' weights (dummy and from a checkpoint that lacks other ranks' experts, quantized
scales included), and routing through replicas computes what one process computes. The groups
only say which share a rank holds (building a model calls no collective)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.layers.quant.methods import cast_model
from dsv4_serving.layers.quant.scheme import QuantScheme
from dsv4_serving.layers.shard import shard_specs
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.loader.weights import load_weights
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsv4_serving.presets.configs import preset_config

ARCH = "DeepseekV4ForCausalLM"
SLOTS = (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)  # 8 experts + 2 redundant, 5 slots per rank


def _model(parallel: ModelParallel, quant: str = "none") -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))
    if quant != "none":
        cfg = dataclasses.replace(cfg, quant=QuantScheme.of(quant))  # type: ignore[arg-type]
    return cast_model(DeepseekV4ForCausalLM(cfg, parallel), torch.float32)


def _rank(r: int, redundant: int = 2) -> ModelParallel:
    g = Group((0, 1), r)
    return ModelParallel(dp=g, ep=g, eplb=True, redundant_experts=redundant)


def _experts_hold(part: DeepseekV4ForCausalLM, full: DeepseekV4ForCausalLM, rank: int) -> int:
    """Every stacked tensor of every MoE layer (weights and scales): slot s of this rank is
    the single-process row of its logical expert."""
    checked = 0
    for (name, p), (_, q) in zip(part.named_parameters(), full.named_parameters(), strict=True):
        if ".experts.w" not in name:
            continue
        for i, e in enumerate(SLOTS[rank * 5 : rank * 5 + 5]):
            assert torch.equal(p[i], q[e]), (name, i, e)
            checked += 1
    return checked


def test_the_initial_placement_fills_every_slot_of_a_layer() -> None:
    part = _model(_rank(1))
    experts = part.layers[0].ffn.experts
    assert experts.num_slots == 10 and experts.w1.shape[0] == 5
    assert experts.slot_map is not None
    assert experts.slot_map.phys_to_log.tolist() == list(SLOTS)
    assert shard_specs(part)["layers.0.ffn.experts.w1"].rows == (5, 6, 7, 0, 1)


@pytest.mark.parametrize("quant", ["none", "fp4", "w8a8"])
@pytest.mark.parametrize("rank", [0, 1])
def test_dummy_weights_fill_each_slot_from_its_logical_expert(rank: int, quant: str) -> None:
    full = _model(ModelParallel(), quant)
    init_dummy_weights(full, seed=3)
    part = _model(_rank(rank), quant)
    init_dummy_weights(part, seed=3)
    stacked = 6 if quant != "none" else 3  # w1/w2/w3 and their scales
    layers = len(part.layers) + len(part.mtp)
    assert _experts_hold(part, full, rank) == stacked * layers * 5


def test_a_checkpoint_without_the_other_ranks_experts_fills_rank_1s_replicas(
    tmp_path: Path,
) -> None:
    full = _model(ModelParallel())
    init_dummy_weights(full, seed=5)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in full.state_dict().items():
        if ".ffn.experts.w" in name:
            stem, w = name.rsplit(".", 1)
            tensors |= {f"{stem}.{e}.{w}.weight": t[e] for e in range(t.shape[0])}
        else:
            tensors[name] = t
    held = set(SLOTS[5:])  # rank 1: experts 5, 6, 7 and the replicas of 0 and 1

    def other(n: str) -> bool:
        return ".ffn.experts." in n and int(n.split(".ffn.experts.")[1].split(".")[0]) not in held

    mine = {n: t.contiguous() for n, t in tensors.items() if not other(n)}
    save_file(mine, str(tmp_path / "mine.safetensors"))
    weight_map = dict.fromkeys(mine, "mine.safetensors")
    weight_map |= {n: "absent.safetensors" for n in tensors if other(n)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    part = _model(_rank(1))
    load_weights(part, tmp_path, ARCH, 4)
    assert _experts_hold(part, full, 1) == 3 * 5 * 5


def _per_choice(parallel: ModelParallel, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    m = _model(parallel)
    init_dummy_weights(m, seed=7)
    experts = m.layers[1].ffn.experts
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return experts.per_choice(x, experts.route(idx), w)


def test_routing_through_replicas_computes_the_single_process_rows() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 128, generator=g)  # dsv4-tiny: hidden 128
    idx = torch.stack(
        [torch.zeros(40, dtype=torch.long), torch.randint(1, 8, (40,), generator=g)], 1
    )
    one = _per_choice(ModelParallel(), x, idx)
    parts = [_per_choice(_rank(r), x, idx) for r in (0, 1)]
    # each (token, choice) row is computed by exactly one rank: the sum is exact
    nonzero = torch.stack([p.abs().sum(-1) > 0 for p in parts])
    assert torch.equal(nonzero.sum(0), torch.ones(40, 2, dtype=torch.long))
    # expert 0 (every token's first choice) has replicas in slots 0 and 8: both ranks serve it
    assert nonzero[0, :, 0].any() and nonzero[1, :, 0].any()
    # not bitwise: a replica multiplies a subset of its expert's tokens, and a CPU GEMM's row
    # may round differently with the batch's row count
    torch.testing.assert_close(parts[0] + parts[1], one, rtol=0, atol=1e-6)
