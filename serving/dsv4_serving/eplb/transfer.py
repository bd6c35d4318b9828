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
    """One move per new slot (identity moves included): where its weights come from."""
    if len(old) != len(new) or len(new) % ranks:
        raise ValueError(f"placements of {len(old)} and {len(new)} slots over {ranks} ranks")
    per = len(new) // ranks
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        holders.setdefault(e, []).append(s)
    moves = []
    for s, e in enumerate(new):
        if e not in holders:
            raise ValueError(f"logical expert {e} has no slot in the old placement")
        r = s // per
        local = [o for o in holders[e] if o // per == r]
        src = s if old[s] == e else (local[0] if local else holders[e][s % len(holders[e])])
        moves.append(Move(s, src))
    return moves


def apply_moves(
    stacks: Sequence[torch.Tensor],
    moves: Sequence[Move],
    rank: int,
    ranks: Sequence[int],
    group: Any = None,
) -> list[torch.Tensor]:
    """This rank's new local stacks (each ``[slots_per_rank, ...]``) after ``moves``.

    ``rank`` is this rank's index in the EP group, ``ranks`` the group's global ranks (what
    torch's point-to-point calls address). With one rank every move is a local copy.
    """
    import torch.distributed as dist

    per = stacks[0].shape[0]
    out = [torch.empty_like(t) for t in stacks]
    ops = []
    n = len(stacks)
    for m in moves:
        src, dst = m.src_slot // per, m.dst_slot // per
        if dst == rank and src == rank:
            for i, t in enumerate(stacks):
                out[i][m.dst_slot - rank * per].copy_(t[m.src_slot - rank * per])
        elif dst == rank:
            for i in range(n):
                buf = out[i][m.dst_slot - rank * per]
                ops.append(dist.P2POp(dist.irecv, buf, ranks[src], group, m.dst_slot * n + i))
        elif src == rank:
            for i, t in enumerate(stacks):
                ops.append(
                    dist.P2POp(
                        dist.isend,
                        t[m.src_slot - rank * per],
                        ranks[dst],
                        group,
                        m.dst_slot * n + i,
                    )
                )
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out
