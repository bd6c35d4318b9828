"""The rank layout of one engine instance: world = tp x dp, EP spanning the world.

vLLM's order: ``rank = dp_rank * tp + tp_rank``, so a TP group is a contiguous run of ranks
(one node on Ascend: TP 8 = one node's NPUs) and a DP group takes every ``tp``-th rank.
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

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "nnodes"):
            if getattr(self, name) < 1:
                raise TopologyError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ep not in (1, self.world):
            raise TopologyError(
                f"expert parallel size {self.ep} must be 1 or tp x dp = {self.world}: "
                "EP spans the DP x TP world"
            )
        if self.world % self.nnodes:
            raise TopologyError(
                f"world size {self.world} (tp {self.tp} x dp {self.dp}) does not split evenly "
                f"over {self.nnodes} nodes"
            )

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nnodes

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.tp + tp_rank

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` among its node's ranks: its device index there."""
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        n = self.ranks_per_node
        return list(range(node * n, (node + 1) * n))

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(d, t) for t in range(self.tp)] for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, t) for d in range(self.dp)] for t in range(self.tp)]

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
