"""Which slice of a logical (checkpoint-shaped) tensor a rank's parameter holds.

A parallel module lists its sharded parameters in ``self.shards`` (local name -> spec); the
loader narrows each checkpoint tensor by the spec and the dummy initialiser generates the
logical tensor and slices it, so a split model holds exactly the single-process values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class ShardSpec:
    dim: int  # the split dimension of the logical tensor
    start: int
    length: int
    full: int  # logical size along ``dim``

    def narrow(self, t: torch.Tensor, dim_offset: int = 0) -> torch.Tensor:
        """This rank's slice; ``dim_offset`` = -1 for one row of a stacked tensor (an expert)."""
        return t.narrow(self.dim + dim_offset, self.start, self.length)

    def logical_shape(self, local: torch.Size) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = self.full
        return tuple(shape)

    def holds(self, index: int) -> bool:
        return self.start <= index < self.start + self.length


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Full parameter name -> spec, for every sharded parameter of ``model``."""
    out: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules():
        for local, spec in getattr(module, "shards", {}).items():
            out[f"{prefix}.{local}" if prefix else local] = spec
    return out
