"""MoE dispatch/combine across ranks, behind one interface.

``dispatch`` hands the experts every token any of this rank's experts may need (with the
router's choices); the experts return one row per (token, choice), zero for choices another
rank computes; ``combine`` sums the routed rows and the shared experts' TP-partial output back
into this rank's tokens.

- ``Replicated`` (DP = 1, or EP off): every rank of the TP group already holds the same tokens;
  local experts, then one all-reduce over TP (= EP when EP is on).
- ``AllGather`` (EP over DP ranks with different tokens): gather tokens over DP, compute local
  experts on all of them, all-reduce over the EP world and keep this DP rank's rows (vLLM's
  AgRs; ``comm.reduce_scatterv`` / ``comm.all_to_allv`` are native on nccl/hccl but not called
  here yet: the EP group is tp x dp while the shares are per DP rank; all2all / Ascend MC2
  slot in here).
- exact (either): the all-reduce carries ``[T, k, D]`` rows (each non-zero on one rank, so the
  sum is exact) and the sum over ``k`` runs locally in the single-process order: EP results are
  bitwise equal to one process (k x traffic; tests and CPU).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from dsv4_serving.distributed.comm import all_gather_sizes, all_gatherv, all_reduce
from dsv4_serving.distributed.groups import ModelParallel


class Dispatched(NamedTuple):
    """The tokens the local experts run on, their router choices, and how many rows came
    from each DP rank (``(T,)`` when nothing was gathered)."""

    x: torch.Tensor
    idx: torch.Tensor
    weights: torch.Tensor
    sizes: tuple[int, ...]


class MoEComm(Protocol):
    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Dispatched: ...

    def combine(self, routed: torch.Tensor, shared: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """``routed`` [T_all, k, D] per choice, ``shared`` [T, D] TP-partial -> [T, D]."""
        ...


class Replicated:
    def __init__(self, parallel: ModelParallel) -> None:
        self.p = parallel

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Dispatched:
        return Dispatched(x, idx, w, (x.shape[0],))

    def combine(self, routed: torch.Tensor, shared: torch.Tensor, d: Dispatched) -> torch.Tensor:
        tp = self.p.tp
        if self.p.exact_moe and self.p.ep.size > 1:
            return all_reduce(routed, self.p.ep).sum(dim=1) + all_reduce(shared, tp)
        return all_reduce(routed.sum(dim=1) + shared, tp)


class AllGather:
    def __init__(self, parallel: ModelParallel) -> None:
        self.p = parallel

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Dispatched:
        dp = self.p.dp
        sizes = all_gather_sizes(x.shape[0], dp, x.device)
        return Dispatched(
            all_gatherv(x, sizes, dp),
            all_gatherv(idx, sizes, dp),
            all_gatherv(w, sizes, dp),
            tuple(sizes),
        )

    def combine(self, routed: torch.Tensor, shared: torch.Tensor, d: Dispatched) -> torch.Tensor:
        start = sum(d.sizes[: self.p.dp.index])
        mine = slice(start, start + d.sizes[self.p.dp.index])
        if self.p.exact_moe:
            routed = all_reduce(routed, self.p.ep)[mine].sum(dim=1)
            return routed + all_reduce(shared, self.p.tp)
        # this TP group's shared partials ride on the same all-reduce, at this DP rank's rows
        y = routed.sum(dim=1)
        y[mine] += shared
        return all_reduce(y, self.p.ep)[mine]


def make_moe_comm(parallel: ModelParallel) -> MoEComm:
    return AllGather(parallel) if parallel.moe_comm == "allgather" else Replicated(parallel)
