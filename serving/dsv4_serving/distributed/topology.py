"""The rank layout of one engine instance: world = tp x cp x dp, EP spanning the world.

The order: ``rank = (dp_rank * cp + cp_rank) * tp + tp_rank`` (vLLM's ``dp * tp + tp_rank``
when cp is 1), so a TP group is a contiguous run of ranks (one node on Ascend: TP 8 = one
node's NPUs), a CP group takes every ``tp``-th rank inside one DP rank, and a DP group every
``tp x cp``-th rank. The ``tp x cp`` ranks of one DP rank run the same steps (its step group:
the core broadcasts each step over it).
Pure Python: the engine config validates a topology without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TopologyError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Topology:
    tp: int = 1
    dp: int = 1
    ep: int = 1
    nnodes: int = 1
    cp: int = 1  # context parallel: a prefill's tokens split over cp ranks (prefill only)

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "nnodes", "cp"):
            if getattr(self, name) < 1:
                raise TopologyError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ep > 1 and self.cp > 1:
            # CP ranks hold different tokens: the MoE would need the DP all-gather path
            raise TopologyError(
                "expert parallel (--expert-parallel-size) with context parallel "
                "(--context-parallel-size) is not supported yet"
            )
        if self.ep not in (1, self.world):
            raise TopologyError(
                f"expert parallel size {self.ep} must be 1 or tp x dp = {self.world}: "
                "EP spans the DP x TP world"
            )
        if self.world % self.nnodes:
            raise TopologyError(
                f"world size {self.world} ({self.shape}) does not split evenly "
                f"over {self.nnodes} nodes"
            )

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def shape(self) -> str:
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return f"tp {self.tp}{cp} x dp {self.dp}"

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nnodes

    def rank(self, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return (dp_rank * self.cp + cp_rank) * self.tp + tp_rank

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp % self.cp

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.cp)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` among its node's ranks: its device index there."""
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        n = self.ranks_per_node
        return list(range(node * n, (node + 1) * n))

    def tp_groups(self) -> list[list[int]]:
        return [
            [self.rank(d, t, c) for t in range(self.tp)]
            for d in range(self.dp)
            for c in range(self.cp)
        ]

    def cp_groups(self) -> list[list[int]]:
        return [
            [self.rank(d, t, c) for c in range(self.cp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def dp_groups(self) -> list[list[int]]:
        return [
            [self.rank(d, t, c) for d in range(self.dp)]
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def step_groups(self) -> list[list[int]]:
        """The tp x cp ranks of each DP rank (contiguous): they run the same steps."""
        n = self.tp * self.cp
        return [list(range(d * n, (d + 1) * n)) for d in range(self.dp)]

    def ep_groups(self) -> list[list[int]]:
        return [list(range(self.world))] if self.ep > 1 else [[r] for r in range(self.world)]

    def check_local_devices(self, visible: int) -> None:
        if self.ranks_per_node > visible:
            raise TopologyError(
                f"{self.ranks_per_node} ranks per node but only {visible} visible devices"
            )

    def check_model(self, cfg: Any) -> None:
        """The model's dimensions split evenly: attention heads, V4 output groups, vocab and
        dense/shared intermediates over TP; routed experts over EP (or their intermediate
        over TP when EP is off)."""
        tp, ep = self.tp, self.ep
        checks = [
            ("attention heads", cfg.num_attention_heads, tp, "tp"),
            ("vocab size", cfg.vocab_size, tp, "tp"),
            ("moe_intermediate_size", cfg.moe_intermediate_size, tp, "tp"),
            ("routed experts", cfg.n_routed_experts, ep, "ep"),
        ]
        if hasattr(cfg, "o_groups"):
            checks.append(("output groups (o_groups)", cfg.o_groups, tp, "tp"))
        if hasattr(cfg, "intermediate_size"):
            checks.append(("dense intermediate_size", cfg.intermediate_size, tp, "tp"))
        for what, n, size, flag in checks:
            if n % size:
                raise TopologyError(f"{what} {n} is not divisible by {flag} {size}")
