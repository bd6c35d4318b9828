"""A rank's shard of a checkpoint: each tensor narrowed by its ShardSpec, other ranks' experts
never read, dummy weights sliced from the single-process values. Single process: the groups
only say which share a rank holds (building a model calls no collective)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.layers.shard import shard_specs
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.loader.names import to_transformers_state_dict
from dsv4_serving.loader.weights import load_weights
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsv4_serving.presets.configs import preset_config

ARCH = "DeepseekV4ForCausalLM"


def _model(parallel: ModelParallel, **over: int) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config.from_dict({**preset_config("dsv4-tiny"), **over})
    return DeepseekV4ForCausalLM(cfg, parallel).float()


def _pair(rank: int) -> Group:
    return Group((0, 1), rank)


def _assert_holds_its_shard(part: DeepseekV4ForCausalLM, full: DeepseekV4ForCausalLM) -> int:
    specs = shard_specs(part)
    whole = dict(full.named_parameters()) | dict(full.named_buffers())
    for name, p in list(part.named_parameters()) + list(part.named_buffers()):
        spec = specs.get(name)
        want = whole[name] if spec is None else spec.narrow(whole[name])
        assert torch.equal(p, want), name
    return len(specs)


@pytest.mark.parametrize("rank", [0, 1])
def test_dummy_weights_of_a_shard_are_the_single_process_values_sliced(rank: int) -> None:
    full = _model(ModelParallel())
    init_dummy_weights(full, seed=4)
    part = _model(ModelParallel(tp=_pair(rank), ep=_pair(rank)))
    init_dummy_weights(part, seed=4)
    assert part.layers[0].ffn.experts.w1.shape == (4, 64, 128)
    assert part.layers[0].attn.wq_b.weight.shape == (256, 64)
    assert _assert_holds_its_shard(part, full) > 0


def test_an_ep_rank_never_opens_the_file_of_another_ranks_experts(tmp_path: Path) -> None:
    full = _model(ModelParallel())
    init_dummy_weights(full, seed=4)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in full.state_dict().items():
        if ".ffn.experts.w" in name:  # native per-expert names
            stem, w = name.rsplit(".", 1)
            tensors |= {f"{stem}.{e}.{w}.weight": t[e] for e in range(t.shape[0])}
        else:
            tensors[name] = t
    mine = {n: t.contiguous() for n, t in tensors.items() if not _other_expert(n)}
    save_file(mine, str(tmp_path / "mine.safetensors"))
    weight_map = dict.fromkeys(mine, "mine.safetensors")
    # experts 4-7 belong to rank 1: their file does not even exist here
    weight_map |= {n: "absent.safetensors" for n in tensors if _other_expert(n)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    part = _model(ModelParallel(tp=_pair(0), ep=_pair(0)))
    load_weights(part, tmp_path, ARCH, 4)
    _assert_holds_its_shard(part, full)


def _other_expert(name: str) -> bool:
    return ".ffn.experts." in name and int(name.split(".ffn.experts.")[1].split(".")[0]) >= 4


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_rank_narrows_transformers_stacked_experts_and_heads(rank: int, tmp_path: Path) -> None:
    full = _model(ModelParallel(), num_nextn_predict_layers=0)
    init_dummy_weights(full, seed=9)
    hf = to_transformers_state_dict(full.state_dict(), ARCH)
    save_file({n: t.contiguous() for n, t in hf.items()}, str(tmp_path / "model.safetensors"))
    part = _model(ModelParallel(tp=_pair(rank)), num_nextn_predict_layers=0)
    load_weights(part, tmp_path, ARCH, 4)
    # EP off: every expert, half of its intermediate dim
    assert part.layers[1].ffn.experts.w2.shape == (8, 128, 32)
    _assert_holds_its_shard(part, full)
