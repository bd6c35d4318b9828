"""Tensor-parallel linears (nano-vllm's semantics): bias-free, as every DeepSeek projection.

Column: the output features are split, each rank computes its slice (no communication).
Row: the input features are split, each rank computes a partial sum, summed over the group
(or left partial with ``reduce=False`` when a later all-reduce covers it). With a size-1 group
both are a plain linear of the full shape. The weight is held and applied by a quant method
(``layers/quant/methods.py``): the compute dtype by default, fp8/W8A8 when the checkpoint is.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4_serving.distributed.comm import all_reduce
from dsv4_serving.distributed.groups import SOLO, Group
from dsv4_serving.layers.quant.methods import QuantMethod
from dsv4_serving.layers.shard import ShardSpec

UNQUANTIZED = QuantMethod()


def _init(
    layer: ColumnParallelLinear | RowParallelLinear,
    in_features: int,
    out_features: int,
    shards: dict[str, ShardSpec],
    quant: QuantMethod,
) -> None:
    # nn.Linear's own __init__ would allocate and randomly initialise a float weight: the
    # quant method creates the weight (and its scale) in the stored format instead
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    layer.register_parameter("bias", None)
    vars(layer).update(shards=dict(shards), quant=quant)  # the method adds its scales' specs
    quant.create(layer, "weight", (out_features, in_features))


class ColumnParallelLinear(nn.Linear):
    quant: QuantMethod
    shards: dict[str, ShardSpec]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group = SOLO,
        quant: QuantMethod = UNQUANTIZED,
    ) -> None:
        start, length = group.split(out_features)
        shards = {"weight": ShardSpec(0, start, length, out_features)} if group.size > 1 else {}
        _init(self, in_features, length, shards, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant.matmul(self, "weight", x)


class RowParallelLinear(nn.Linear):
    quant: QuantMethod
    shards: dict[str, ShardSpec]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group = SOLO,
        reduce: bool = True,
        quant: QuantMethod = UNQUANTIZED,
    ) -> None:
        start, length = group.split(in_features)
        shards = {"weight": ShardSpec(1, start, length, in_features)} if group.size > 1 else {}
        _init(self, length, out_features, shards, quant)
        self.group = group
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant.matmul(self, "weight", x)
        return all_reduce(y, self.group) if self.reduce else y


class ReplicatedLinear(ColumnParallelLinear):
    """The whole matrix on every rank (DeepSeek's down-projections to a shared latent)."""

    def __init__(
        self, in_features: int, out_features: int, quant: QuantMethod = UNQUANTIZED
    ) -> None:
        super().__init__(in_features, out_features, SOLO, quant)
