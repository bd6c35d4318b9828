"""Moving expert weights to a new placement, one MoE layer at a time.

Every rank computes the same list of moves from the old and new ``phys_to_log`` rows (pure):
a new slot takes its logical expert from a slot of its own rank when one holds it (a local
copy), else from a holder chosen by slot number so senders share the work. Then each rank
posts its sends and receives together (point-to-point on the EP group: gloo on CPU, HCCL or
NCCL on devices through the same calls), builds the new local stacks in fresh buffers and
swaps them in; nothing is overwritten while another rank may still read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Move:
    dst_slot: int
    src_slot: int


def plan_moves(old: Sequence[int], new: Sequence[int], ranks: int) -> list[Move]:
    """One move per new slot (identity moves included): where its weights come from. The
    slot counts may differ (a placement growing redundant slots); each divides over the ranks."""
    if len(old) % ranks or len(new) % ranks:
        raise ValueError(f"placements of {len(old)} and {len(new)} slots over {ranks} ranks")
    old_per, new_per = len(old) // ranks, len(new) // ranks
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        holders.setdefault(e, []).append(s)
    moves = []
    for s, e in enumerate(new):
        if e not in holders:
            raise ValueError(f"logical expert {e} has no slot in the old placement")
        r = s // new_per
        local = [o for o in holders[e] if o // old_per == r]
        same = len(old) == len(new) and old[s] == e
        src = s if same else (local[0] if local else holders[e][s % len(holders[e])])
        moves.append(Move(s, src))
    return moves


def apply_moves(
    stacks: Sequence[torch.Tensor],
    moves: Sequence[Move],
    rank: int,
    ranks: Sequence[int],
    group: Any = None,
    new_per_rank: int | None = None,
) -> list[torch.Tensor]:
    """This rank's new local stacks (each ``[slots_per_rank, ...]``) after ``moves``.

    ``rank`` is this rank's index in the EP group, ``ranks`` the group's global ranks (what
    torch's point-to-point calls address). ``new_per_rank`` when the slot count changes. With
    one rank every move is a local copy.
    """
    import torch.distributed as dist

    old_per = stacks[0].shape[0]
    new_per = old_per if new_per_rank is None else new_per_rank
    out = [t.new_empty((new_per, *t.shape[1:])) for t in stacks]
    ops = []
    n = len(stacks)
    for m in moves:
        src, dst = m.src_slot // old_per, m.dst_slot // new_per
        if dst == rank and src == rank:
            for i, t in enumerate(stacks):
                out[i][m.dst_slot - rank * new_per].copy_(t[m.src_slot - rank * old_per])
        elif dst == rank:
            for i in range(n):
                buf = out[i][m.dst_slot - rank * new_per]
                ops.append(dist.P2POp(dist.irecv, buf, ranks[src], group, m.dst_slot * n + i))
        elif src == rank:
            for i, t in enumerate(stacks):
                ops.append(
                    dist.P2POp(
                        dist.isend,
                        t[m.src_slot - rank * old_per],
                        ranks[dst],
                        group,
                        m.dst_slot * n + i,
                    )
                )
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out
