"""One context-parallel rank's share of a step's flat batch, and the per-layer exchange
(V4's attention and V3's MLA both use it).

Each prefill chunk is split by ``distributed/cp_plan.py:split_chunk`` (zig-zag over the CP
group); a chunk too short to split and every decode row are computed by every rank
(replicated). A rank runs the model on its ``rows``; once per attention layer the cache inputs
of every row are all-gathered (``gather``): each split row from the rank that owns it, the
replicated rows from rank 0, restored to flat order. Then every rank writes the same cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.distributed import comm
from dsv4_serving.distributed.cp_plan import split_chunk
from dsv4_serving.distributed.groups import Group


@dataclass(slots=True)
class CPStats:
    """What a rank's per-layer gathers cost, counted where they run (``CPShare.gather``):
    calls (one per attention layer of a split step), bytes this rank sent (its rows) and
    received (every other rank's), and seconds inside the collective (waiting for a slower
    peer included)."""

    gathers: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "cp_gathers": self.gathers,
            "cp_bytes_sent": self.bytes_sent,
            "cp_bytes_received": self.bytes_received,
            "cp_gather_s": self.seconds,
        }


@dataclass(frozen=True, slots=True)
class CPShare:
    group: Group
    rows: torch.Tensor  # [n] this rank's rows of the flat batch, ascending
    mask: torch.Tensor  # [T] bool: the same rows
    own: torch.Tensor  # [m] indices into ``rows`` of what this rank contributes to a gather
    sizes: list[int]  # every rank's contribution
    restore: torch.Tensor  # [T] flat row -> its row in the gathered concatenation
    stats: CPStats = field(default_factory=CPStats)  # the caller's, to count over many steps

    @classmethod
    def build(
        cls, meta: AttentionMetadata, group: Group, align: int, stats: CPStats | None = None
    ) -> CPShare:
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
            stats or CPStats(),
        )

    def gather(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every row's values of per-row tensors ``[n, w_i]`` given this rank's rows: one
        packed all-gather."""
        widths = [t.shape[-1] for t in local]
        packed = torch.cat(local, dim=-1)[self.own].contiguous()
        start = time.perf_counter()
        gathered = comm.all_gatherv(packed, self.sizes, self.group)
        st = self.stats
        st.seconds += time.perf_counter() - start
        st.gathers += 1
        row = packed.element_size() * sum(widths)
        st.bytes_sent += row * packed.shape[0]
        st.bytes_received += row * (sum(self.sizes) - packed.shape[0])
        full = gathered[self.restore]
        return [t.contiguous() for t in full.split(widths, dim=-1)]

    def chunk_rows(self, a: int, b: int) -> torch.Tensor | None:
        """This rank's rows of the chunk at flat rows ``[a, b)`` as offsets into it
        (ascending), or None when it computes the whole chunk (a replicated chunk)."""
        mine = self.mask[a:b]
        if bool(mine.all()):
            return None
        return mine.nonzero().squeeze(1)

    def scatter(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows in a zero ``[T, ...]`` tensor (the query side reads its rows)."""
        out = local.new_zeros((self.mask.shape[0], *local.shape[1:]))
        out[self.rows] = local
        return out
