"""With one process nothing parallel runs: every collective over a size-1 group hands back its
input (no torch.distributed call: none is initialised here), and the default-built model holds
plain, whole tensors with no shard specs."""

from __future__ import annotations

import torch

from dsv4_serving.distributed import comm
from dsv4_serving.distributed.groups import SINGLE, SOLO, Group, ModelParallel
from dsv4_serving.layers.moe_comm import AllGather, Replicated, make_moe_comm
from dsv4_serving.layers.shard import shard_specs
from dsv4_serving.models.config import DeepseekV3Config
from dsv4_serving.models.deepseek_v3 import DeepseekV3ForCausalLM
from dsv4_serving.presets.configs import preset_config


def test_collectives_over_one_rank_return_their_input() -> None:
    assert not torch.distributed.is_initialized()
    x = torch.arange(6.0).view(3, 2)
    assert comm.all_reduce(x, SOLO) is x
    assert comm.all_gather(x, SOLO) is x
    assert comm.all_gatherv(x, [3], SOLO) is x
    assert comm.reduce_scatterv(x, [3], SOLO) is x
    assert comm.all_gather_sizes(3, SOLO, x.device) == [3]
    assert comm.broadcast_object({"a": 1}, SOLO) == {"a": 1}
    assert comm.gather_object(5, SOLO) == [5]


def test_the_moe_comm_follows_where_tokens_and_experts_live() -> None:
    two = Group((0, 1), 0)
    assert isinstance(make_moe_comm(SINGLE), Replicated)
    assert isinstance(make_moe_comm(ModelParallel(tp=two, ep=two)), Replicated)
    assert isinstance(make_moe_comm(ModelParallel(dp=two)), Replicated)  # EP off
    assert isinstance(make_moe_comm(ModelParallel(dp=two, ep=two)), AllGather)


def test_a_default_model_has_no_shards_and_whole_shapes() -> None:
    m = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(preset_config("dsv3-small")))
    assert shard_specs(m) == {}
    assert m.layers[1].ffn.experts.w1.shape == (8, 128, 256)
    assert m.layers[0].attn.wkv_b.weight.shape == (4 * (64 + 64), 512)
    assert type(m.layers[0].attn.wkv_b).__mro__[1] is torch.nn.Linear


def test_group_split_gives_each_rank_its_even_share() -> None:
    assert [Group((0, 1, 2, 3), i).split(8) for i in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
