"""Typed handles of the process groups a layer talks over, and the model's set of them.

A model is built with a ``ModelParallel``; ``SINGLE`` (every group of size 1) is the default,
so the single-process path builds today's layers and calls no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

MoECommKind = Literal["replicated", "allgather"]


@dataclass(frozen=True, slots=True)
class Group:
    """This rank's view of one group: its members (global ranks) and its index among them."""

    ranks: tuple[int, ...] = (0,)
    index: int = 0
    # torch ProcessGroups; None for a size-1 group (never created, never called)
    device_group: Any = field(default=None, compare=False, repr=False)
    cpu_group: Any = field(default=None, compare=False, repr=False)
    # a node-local shared-memory channel (``shm_comm``) for CPU tensors and objects; None: gloo
    shm: Any = field(default=None, compare=False, repr=False)
    # the device group's backend (gloo, nccl, hccl): which collectives are native
    backend: str = field(default="gloo", compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def split(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``n`` items."""
        if n % self.size:
            raise ValueError(f"{n} does not split evenly over {self.size} ranks")
        length = n // self.size
        return self.index * length, length


SOLO = Group()


@dataclass(frozen=True, slots=True)
class ModelParallel:
    tp: Group = SOLO
    dp: Group = SOLO
    ep: Group = SOLO
    # context parallel: the ranks a prefill's tokens are split over (same TP index, same DP)
    cp: Group = SOLO
    # the tp x cp ranks of this DP rank: they run the same steps (the core broadcasts them);
    # the TP group itself when cp is 1
    step: Group = SOLO
    # the DP ranks again, for the cores' lockstep (turn headers, step agreement, reports): a
    # group of its own, so the core's thread can use it while the step thread's forward
    # all-gathers over ``dp`` (async scheduling)
    dp_control: Group = SOLO
    # MoE combine per (token, choice): EP results bitwise equal to one process (tests, CPU)
    exact_moe: bool = False
    # EPLB (``eplb/``): experts live in physical slots through a per-layer logical -> physical
    # map, ``redundant_experts`` more slots than experts per layer; off: fixed expert blocks
    eplb: bool = False
    redundant_experts: int = 0

    @property
    def moe_comm(self) -> MoECommKind:
        """``allgather`` when experts are spread over DP ranks that hold different tokens."""
        return "allgather" if self.ep.size > 1 and self.dp.size > 1 else "replicated"


SINGLE = ModelParallel()
