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
    # EPLB's expert slots: the logical index each local row holds (repeats = replicas), so the
    # rank takes a gather, not a range; None = the range [start, start + length)
    rows: tuple[int, ...] | None = None

    def narrow(self, t: torch.Tensor, dim_offset: int = 0) -> torch.Tensor:
        """This rank's slice; ``dim_offset`` = -1 for one row of a stacked tensor (an expert)."""
        if self.rows is not None:
            index = torch.tensor(self.rows, dtype=torch.long, device=t.device)
            return t.index_select(self.dim + dim_offset, index)
        return t.narrow(self.dim + dim_offset, self.start, self.length)

    def logical_shape(self, local: torch.Size) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = self.full
        return tuple(shape)

    def holds(self, index: int) -> bool:
        return bool(self.local_rows(index))

    def local_rows(self, index: int) -> list[int]:
        """The local rows holding logical ``index`` (several for replicated experts)."""
        if self.rows is not None:
            return [r for r, i in enumerate(self.rows) if i == index]
        return [index - self.start] if self.start <= index < self.start + self.length else []


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Full parameter name -> spec, for every sharded parameter of ``model``."""
    out: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules():
        for local, spec in getattr(module, "shards", {}).items():
            out[f"{prefix}.{local}" if prefix else local] = spec
    return out
