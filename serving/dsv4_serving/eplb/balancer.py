"""EPLB inside the engine, on one rank: count expert load, re-place experts every ``interval``
steps, live.

Every EP rank runs the same forward steps (TP followers run the core's, idle DP ranks a dummy
batch), so each calls ``end_step`` the same number of times and they meet in the same
collectives without any extra agreement:

1. ``begin(real)`` before a forward: whether its tokens count (a dummy batch counts nothing;
   under TP only TP rank 0 counts, its followers hold the same tokens).
2. Each MoE layer routes through its ``ExpertMap`` and reports the physical slots chosen; the
   ``LoadWindow`` keeps the last ``window`` steps.
3. Every ``interval`` steps: the window is summed over the EP group, EP rank 0 plans
   (``algorithm.rebalance``) and broadcasts the plan; layers the plan does not improve stay.
4. Then one layer per step, at the step's end: its expert stacks (weights and quantized scales:
   every parameter of ``layers.moe.Experts`` is stacked by slot) move point-to-point (``transfer``) and
   its map is swapped. A step never waits for more than one layer's weights, and every
   forward sees each layer whole: serving never stops, and outputs do not change (bitwise
   with exact MoE; up to float rounding otherwise).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Protocol, cast

import torch
from torch import nn

from dsv4_serving.distributed.comm import all_reduce, broadcast_object
from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.eplb.algorithm import (
    Placement,
    imbalance,
    layers_worth_moving,
    rank_loads,
    rebalance,
)
from dsv4_serving.eplb.state import ExpertMap, LoadWindow, Recorder
from dsv4_serving.eplb.stats import EplbStats
from dsv4_serving.eplb.transfer import apply_moves, plan_moves

log = logging.getLogger(__name__)


class SlotStacks(Protocol):
    """What the balancer needs of a MoE layer's experts (``layers.moe.Experts`` built with
    EPLB): the map, the sizes, a recorder hook, and ``place`` after its stacks moved. Every
    parameter of the module is stacked by local slot."""

    slot_map: ExpertMap | None
    recorder: Recorder | None
    num_experts: int
    num_slots: int

    def place(self, phys_to_log: Sequence[int]) -> None: ...

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]: ...


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A view every backend can send (gloo has no fp8)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def rank_imbalance(physical: torch.Tensor, ranks: int) -> list[float]:
    """[layers, slots] tokens -> per layer max / mean tokens per rank."""
    per_rank = physical.view(physical.shape[0], ranks, -1).sum(dim=-1)
    return [imbalance([float(v) for v in row]) for row in per_rank.tolist()]


class Balancer:
    def __init__(
        self,
        model: nn.Module,
        ep: Group,
        counts: bool,
        interval: int,
        window: int,
        groups: int = 1,
        nodes: int = 1,
    ) -> None:
        """``counts``: this rank's tokens are its DP rank's own (TP rank 0)."""
        # the layers built with EPLB's slots (duck-typed: eplb sits below the layers)
        named = [
            (n, cast(SlotStacks, m))
            for n, m in model.named_modules()
            if getattr(m, "slot_map", None) is not None
        ]
        self.layers = [m for _, m in named]
        self.names = tuple(n.removesuffix(".experts").removesuffix(".ffn") for n, _ in named)
        if not self.layers:
            raise ValueError("EPLB: the model has no MoE layer built with expert slots")
        first = self.layers[0]
        assert first.slot_map is not None
        self.num_logical = first.num_experts
        self.slots = first.num_slots
        self.device = first.slot_map.phys_to_log.device
        self.ep, self.counts = ep, counts
        self.interval, self.groups, self.nodes = interval, groups, nodes
        self.window = LoadWindow(len(self.layers), self.slots, window, self.device)
        self.real = False
        self.pending: list[tuple[int, tuple[int, ...]]] = []  # (layer, new phys_to_log)
        self.stats = EplbStats(layers=self.names)
        self._plan_step = 0
        self._plan_before: list[float] = []
        self._plan_after: list[float] = []
        self._moved = 0
        self._move_s = 0.0
        for i, m in enumerate(self.layers):
            m.recorder = self._recorder(i)

    @classmethod
    def for_model(
        cls, model: nn.Module, parallel: ModelParallel, interval: int, window: int, **kw: int
    ) -> Balancer:
        return cls(model, parallel.ep, parallel.tp.index == 0, interval, window, **kw)

    def _recorder(self, layer: int) -> Recorder:
        def record(phys: torch.Tensor) -> None:
            if self.real:
                self.window.record(layer, phys, phys.shape[0])

        return record

    def begin(self, real: bool) -> None:
        """Before a forward (or the MTP calls of one): do its tokens count?"""
        self.real = real and self.counts

    def placement(self) -> list[tuple[int, ...]]:
        """Every layer's current ``phys_to_log``."""
        return [tuple(m.slot_map.phys_to_log.tolist()) for m in self.layers if m.slot_map]

    def end_step(self) -> None:
        """After every forward step, on every EP rank."""
        self.real = False
        steps = self.window.steps + 1
        if not self.pending and steps % self.interval == 0:
            self._plan(steps)
        if self.pending:
            t = time.perf_counter()
            layer, row = self.pending.pop(0)
            self._move(layer, row)
            self._move_s += time.perf_counter() - t
            if not self.pending:
                self._finish(steps)
        self.window.step()
        self.stats = replace(self.stats, step=steps)

    def _plan(self, step: int) -> None:
        load = all_reduce(self.window.physical().clone(), self.ep)
        if not int(load.sum()):
            return  # nothing real ran in the window
        p2l = torch.stack([m.slot_map.phys_to_log for m in self.layers if m.slot_map])
        logical = torch.zeros(len(self.layers), self.num_logical, dtype=load.dtype)
        logical = logical.to(load.device).scatter_add_(1, p2l.to(load.device), load)
        rows = [[float(v) for v in r] for r in logical.tolist()]
        plan: Placement | None = None
        if self.ep.index == 0:
            plan = rebalance(rows, self.slots, self.groups, self.nodes, self.ep.size)
        plan = broadcast_object(plan, self.ep)
        assert plan is not None
        before = rank_imbalance(load, self.ep.size)
        after = [imbalance(r) for r in rank_loads(plan, rows, self.ep.size)]
        # a layer moves only where the plan carries the window's load clearly more evenly than
        # the current placement, both estimated alike (a reshuffle of a balanced layer stays)
        moving_layers = layers_worth_moving(self.placement(), plan, rows, self.ep.size)
        self.pending = [(i, plan.phys_to_log[i]) for i in moving_layers]
        self._plan_step, self._plan_before = step, before
        moving = {i for i, _ in self.pending}
        self._plan_after = [
            a if i in moving else b for i, (b, a) in enumerate(zip(before, after, strict=True))
        ]
        self._moved, self._move_s = len(self.pending), 0.0

    def _move(self, layer: int, row: Sequence[int]) -> None:
        m = self.layers[layer]
        assert m.slot_map is not None
        old = m.slot_map.phys_to_log
        moves = plan_moves(old.tolist(), list(row), self.ep.size)
        params = [p for _, p in m.named_parameters(recurse=False)]
        fresh = apply_moves(
            [_wire(p.data) for p in params],
            moves,
            self.ep.index,
            self.ep.ranks,
            self.ep.device_group,
        )
        with torch.no_grad():
            for p, t in zip(params, fresh, strict=True):
                p.data = t.view(p.dtype)
        m.place(row)
        assert m.slot_map is not None
        self.window.remap(layer, old, m.slot_map.phys_to_log, self.num_logical)

    def _finish(self, step: int) -> None:
        """The last layer moved: the stats, and one log line (from EP rank 0) per re-placement."""
        before, after = self._plan_before, self._plan_after
        self.stats = EplbStats(
            rearrangements=self.stats.rearrangements + 1,
            layers_moved=self.stats.layers_moved + self._moved,
            layers=self.names,
            imbalance_before=tuple(before),
            imbalance_after=tuple(after),
            step=step,
        )
        if self.ep.index:
            return
        log.info(
            "EPLB re-placement %d (planned at step %d): %d of %d MoE layers moved over %d "
            "steps (%.1f ms of moves); worst layer imbalance (max/mean tokens per EP rank) "
            "%.2f -> %.2f, mean %.2f -> %.2f",
            self.stats.rearrangements,
            self._plan_step,
            self._moved,
            len(self.layers),
            step - self._plan_step + 1,
            1e3 * self._move_s,
            max(before),
            max(after),
            sum(before) / len(before),
            sum(after) / len(after),
        )
