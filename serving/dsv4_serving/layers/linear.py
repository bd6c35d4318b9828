"""Tensor-parallel linears (nano-vllm's semantics): bias-free, as every DeepSeek projection.

Column: the output features are split, each rank computes its slice (no communication).
Row: the input features are split, each rank computes a partial sum, summed over the group
(or left partial with ``reduce=False`` when a later all-reduce covers it). With a size-1 group
both are a plain ``nn.Linear`` of the full shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_serving.distributed.comm import all_reduce
from dsv4_serving.distributed.groups import SOLO, Group
from dsv4_serving.layers.shard import ShardSpec


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, group: Group = SOLO) -> None:
        start, length = group.split(out_features)
        super().__init__(in_features, length, bias=False)
        self.shards = (
            {"weight": ShardSpec(0, start, length, out_features)} if group.size > 1 else {}
        )


class RowParallelLinear(nn.Linear):
    def __init__(
        self, in_features: int, out_features: int, group: Group = SOLO, reduce: bool = True
    ) -> None:
        start, length = group.split(in_features)
        super().__init__(length, out_features, bias=False)
        self.shards = {"weight": ShardSpec(1, start, length, in_features)} if group.size > 1 else {}
        self.group = group
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_reduce(y, self.group) if self.reduce else y
