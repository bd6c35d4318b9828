"""One context-parallel rank's share of a step's flat batch, and the per-layer exchange.

Each prefill chunk is split by ``distributed/cp_plan.py:split_chunk`` (zig-zag over the CP
group); a chunk too short to split and every decode row are computed by every rank
(replicated). A rank runs the model on its ``rows``; once per attention layer the cache inputs
of every row are all-gathered (``gather``): each split row from the rank that owns it, the
replicated rows from rank 0, restored to flat order. Then every rank writes the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.distributed import comm
from dsv4_serving.distributed.cp_plan import split_chunk
from dsv4_serving.distributed.groups import Group


@dataclass(frozen=True, slots=True)
class CPShare:
    group: Group
    rows: torch.Tensor  # [n] this rank's rows of the flat batch, ascending
    mask: torch.Tensor  # [T] bool: the same rows
    own: torch.Tensor  # [m] indices into ``rows`` of what this rank contributes to a gather
    sizes: list[int]  # every rank's contribution
    restore: torch.Tensor  # [T] flat row -> its row in the gathered concatenation

    @classmethod
    def build(cls, meta: AttentionMetadata, group: Group, align: int) -> CPShare:
        qsl, cp = meta.query_start_loc, group.size
        split: list[list[int]] = [[] for _ in range(cp)]
        replicated: list[int] = []
        for i in range(len(qsl) - 1):
            start, n = qsl[i], qsl[i + 1] - qsl[i]
            parts = split_chunk(n, cp, align) if n > 1 else [[(0, n)]] * cp
            if len(parts[0]) == 1:
                replicated.extend(range(start, start + n))
                continue
            for r in range(cp):
                split[r].extend(p for a, b in parts[r] for p in range(start + a, start + b))
        mine = sorted(split[group.index] + replicated)
        owned = [sorted(split[r] + (replicated if r == 0 else [])) for r in range(cp)]
        order = torch.tensor([p for o in owned for p in o], dtype=torch.long)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel())
        rows = torch.tensor(mine, dtype=torch.long)
        mask = torch.zeros(meta.num_tokens, dtype=torch.bool)
        mask[rows] = True
        own = torch.searchsorted(rows, torch.tensor(owned[group.index], dtype=torch.long))
        dev = meta.positions.device
        return cls(
            group,
            rows.to(dev),
            mask.to(dev),
            own.to(dev),
            [len(o) for o in owned],
            restore.to(dev),
        )

    def gather(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every row's values of per-row tensors ``[n, w_i]`` given this rank's rows: one
        packed all-gather."""
        widths = [t.shape[-1] for t in local]
        packed = torch.cat(local, dim=-1)[self.own].contiguous()
        full = comm.all_gatherv(packed, self.sizes, self.group)[self.restore]
        return [t.contiguous() for t in full.split(widths, dim=-1)]

    def scatter(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows in a zero ``[T, ...]`` tensor (the query side reads its rows)."""
        out = local.new_zeros((self.mask.shape[0], *local.shape[1:]))
        out[self.rows] = local
        return out
