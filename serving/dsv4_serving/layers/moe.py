"""Mixture-of-experts FFNs over a flat batch of tokens.

Routed experts are stored stacked (``w1``/``w3`` [E, I, D], ``w2`` [E, D, I]) so one gather
serves a batch; the loader maps per-expert checkpoint tensors into the stack. Under expert
parallelism a rank stacks only its contiguous block of experts; with EP off and TP on, every
rank holds every expert's slice of the intermediate dim. Shared experts and dense MLPs are
TP-sharded (column/row), their partial sums reduced together with the routed output.

With EPLB (``parallel.eplb``) the stack holds physical *slots* instead: ``num_experts`` +
``redundant_experts`` per layer, an equal block per EP rank, each slot a copy of one logical
expert (``slot_map``); the router's choices go through the map (``route``) and the balancer
(``eplb/balancer.py``) moves slots between ranks and swaps the map.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_serving.distributed.groups import SINGLE, SOLO, Group, ModelParallel
from dsv4_serving.eplb.algorithm import initial_placement
from dsv4_serving.eplb.state import ExpertMap, Recorder
from dsv4_serving.layers.linear import ColumnParallelLinear, RowParallelLinear
from dsv4_serving.layers.moe_comm import make_moe_comm
from dsv4_serving.layers.quant.methods import QuantMethod, QuantMethods
from dsv4_serving.layers.shard import ShardSpec


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``; with ``limit`` > 0 the gate is clamped above at ``limit`` and
    the up projection to ``[-limit, limit]`` (V4's clamped SwiGLU)."""

    def __init__(
        self,
        dim: int,
        inter: int,
        limit: float = 0.0,
        group: Group = SOLO,
        reduce: bool = True,
        quant: QuantMethod | None = None,
    ) -> None:
        super().__init__()
        q = quant or QuantMethod()
        self.w1 = ColumnParallelLinear(dim, inter, group, q)
        self.w2 = RowParallelLinear(inter, dim, group, reduce, q)
        self.w3 = ColumnParallelLinear(dim, inter, group, q)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit > 0:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        out: torch.Tensor = self.w2(F.silu(gate) * up)
        return out


class Experts(nn.Module):
    w1: torch.Tensor  # registered by the quant method (with their scales)
    w2: torch.Tensor
    w3: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        dim: int,
        inter: int,
        limit: float = 0.0,
        parallel: ModelParallel = SINGLE,
        quant: QuantMethod | None = None,
    ) -> None:
        super().__init__()
        self.shards: dict[str, ShardSpec] = {}
        ep = parallel.ep
        eplb = parallel.eplb and ep.size > 1
        self.num_slots = num_experts + (parallel.redundant_experts if eplb else 0)
        first, local = ep.split(self.num_slots)
        # logical -> physical slots (EPLB), None: slot = expert; ``recorder`` counts the load
        self.slot_map: ExpertMap | None = None
        self.recorder: Recorder | None = None
        self.ep, self.num_experts = ep, num_experts
        if eplb:  # physical slots, each a copy of its logical expert
            self.place(initial_placement(num_experts, self.num_slots))
        elif ep.size > 1:  # a block of whole experts
            self.shards = {w: ShardSpec(0, first, local, num_experts) for w in ("w1", "w2", "w3")}
        elif parallel.tp.size > 1:  # every expert, a slice of its intermediate dim
            start, part = parallel.tp.split(inter)
            self.shards = {
                "w1": ShardSpec(1, start, part, inter),
                "w3": ShardSpec(1, start, part, inter),
                "w2": ShardSpec(2, start, part, inter),
            }
            inter = part
        # stacked [E, out, in]; the quant method holds them (and their scales, sharded alike)
        self.quant = quant or QuantMethod()
        self.quant.create(self, "w1", (local, inter, dim))
        self.quant.create(self, "w3", (local, inter, dim))
        self.quant.create(self, "w2", (local, dim, inter))
        self.limit = limit
        self.first = first

    def place(self, phys_to_log: Sequence[int]) -> None:
        """Slot ``s`` now holds logical expert ``phys_to_log[s]`` (the loader fills a slot from
        its expert; the balancer calls this after moving the weights)."""
        first, local = self.ep.split(self.num_slots)
        # built under the model's device context; later on the device the map is on
        old = self.slot_map
        device = old.phys_to_log.device if old is not None else torch.get_default_device()
        self.slot_map = ExpertMap(phys_to_log, self.num_experts, device)
        rows = tuple(phys_to_log[first : first + local])
        spec = ShardSpec(0, first, local, self.num_experts, rows)
        # the scales the quant method registered shard (and so move) with their weights
        self.shards = {n: spec for n in ("w1", "w2", "w3")} | {
            n: replace(s, rows=rows) for n, s in self.shards.items() if s.dim == 0
        }

    def route(self, idx: torch.Tensor) -> torch.Tensor:
        """The router's logical choices [T, k] -> the slots that compute them (the same ids
        without EPLB); the recorder, when set, counts them."""
        if self.slot_map is None:
            return idx
        phys = self.slot_map.route(idx)
        if self.recorder is not None:
            self.recorder(phys)
        return phys

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` [T, D], ``idx``/``weights`` [T, k] -> [T, D]."""
        return self.per_choice(x, idx, weights).sum(dim=1)

    def per_choice(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[T, k, D]: each (token, choice)'s weighted output; zero where another rank holds
        the chosen expert."""
        if type(self.quant) is QuantMethod:
            return self._grouped(x, idx, weights)
        return self._per_expert(x, idx, weights)

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weights in the compute dtype: every local expert in one batched product per matrix.
        The (token, choice) rows go into a buffer ``[local, cap, D]`` (``cap``: the busiest
        expert's count, over all ranks; a padded row only costs its own output row, which
        nobody reads), choices of other ranks' experts into one spare row whose output is
        zero. About 15 ops per layer whatever the number of experts, instead of ~10 per
        expert."""
        t, k = idx.shape
        local, dim = self.w1.shape[0], x.shape[1]
        flat = idx.reshape(-1)
        # ``cap`` over every expert, not just this rank's: an expert's product then has the
        # same shape on every rank as in one process, so splitting the experts changes no bit
        cap = int(torch.bincount(flat, minlength=self.num_slots).max())
        le = flat - self.first
        mine = (le >= 0) & (le < local)
        le = torch.where(mine, le, local)  # bucket ``local``: another rank's expert
        counts = torch.bincount(le, minlength=local + 1)
        if not bool(mine.any()):
            return x.new_zeros((t, k, dim))
        order = torch.argsort(le, stable=True)
        sorted_e = le[order]
        rank_in_expert = (
            torch.arange(t * k, device=x.device) - (counts.cumsum(0) - counts)[sorted_e]
        )
        row = torch.empty_like(le)
        row[order] = torch.where(sorted_e < local, sorted_e * cap + rank_in_expert, local * cap)
        x_pad = x.new_zeros((local * cap + 1, dim))
        x_pad[row] = x.repeat_interleave(k, dim=0)
        xs = x_pad[:-1].view(local, cap, dim)
        gate = torch.bmm(xs, self.w1.transpose(1, 2))
        up = torch.bmm(xs, self.w3.transpose(1, 2))
        if self.limit > 0:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        y = torch.bmm(F.silu(gate) * up, self.w2.transpose(1, 2)).view(-1, dim)
        y_pad = torch.cat((y, y.new_zeros((1, dim))))  # the spare row: zero
        return (y_pad[row] * weights.reshape(-1, 1)).to(x.dtype).view(t, k, dim)

    def _per_expert(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Quantized weights: one expert at a time through the quant method's product."""
        t, k = idx.shape
        flat_idx = idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_slots).tolist()
        token_of = order // k
        w_flat = weights.reshape(-1)[order]
        # each (token, choice) pair's output in expert order, then back to [T, k] (summed over
        # the k choices in a fixed order by the caller: no index_add_, slower on CPU and
        # order-dependent)
        local = self.w1.shape[0]
        mm = self.quant.matmul
        every = local == self.num_slots
        ys = x.new_empty((t * k, x.shape[1])) if every else x.new_zeros((t * k, x.shape[1]))
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            le = e - self.first
            if not 0 <= le < local:
                start += c
                continue
            xs = x[token_of[start : start + c]]
            gate, up = mm(self, "w1", xs, le), mm(self, "w3", xs, le)
            if self.limit > 0:
                gate = gate.clamp(max=self.limit)
                up = up.clamp(min=-self.limit, max=self.limit)
            y = mm(self, "w2", F.silu(gate) * up, le)
            ys[start : start + c] = (y * w_flat[start : start + c, None]).to(ys.dtype)
            start += c
        unsorted = torch.empty_like(ys)
        unsorted[order] = ys
        return unsorted.view(t, k, -1)


class V4Gate(nn.Module):
    """V4 router: ``sqrtsoftplus`` scores; the bias only steers selection; hash layers select
    by a frozen token -> experts table instead."""

    tid2eid: torch.Tensor

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        vocab: int,
        hashed: bool,
        scoring: str,
        route_scale: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.top_k = top_k
        self.hashed = hashed
        self.scoring = scoring
        self.route_scale = route_scale
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(vocab, top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(num_experts))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scoring == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.scoring == "sigmoid":
            return logits.sigmoid()
        if self.scoring == "softmax":
            return logits.softmax(dim=-1)
        raise ValueError(f"unknown scoring_func {self.scoring!r}")

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scores(F.linear(x, self.weight))
        if self.hashed:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(s + self.bias, self.top_k, dim=-1, sorted=False).indices
        w = s.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * self.route_scale


class RoutedMoE(nn.Module):
    """Routed experts plus shared experts: the router's choices go to the experts' ranks
    (``comm``), come back weighted, and join the shared experts' output. The V3 and V4 MoEs
    differ only in their router (``gate``)."""

    def __init__(
        self, gate: nn.Module, experts: Experts, shared: SwiGLU, parallel: ModelParallel
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared
        self.comm = make_moe_comm(parallel)

    def _routed(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x`` through the experts the router chose (``idx``, weights ``w``), plus the shared
        experts."""
        d = self.comm.dispatch(x, self.experts.route(idx), w)
        routed = self.experts.per_choice(d.x, d.idx, d.weights)
        return self.comm.combine(routed, self.shared_experts(x), d)


class V4MoE(RoutedMoE):
    def __init__(
        self,
        dim: int,
        inter: int,
        num_experts: int,
        top_k: int,
        vocab: int,
        hashed: bool,
        scoring: str,
        route_scale: float,
        limit: float,
        n_shared: int,
        parallel: ModelParallel = SINGLE,
        quant: QuantMethods | None = None,
    ) -> None:
        q = quant or QuantMethods()
        super().__init__(
            V4Gate(dim, num_experts, top_k, vocab, hashed, scoring, route_scale),
            Experts(num_experts, dim, inter, limit, parallel, q.experts),
            SwiGLU(dim, inter * n_shared, limit, parallel.tp, reduce=False, quant=q.linear),
            parallel,
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self._routed(x, *self.gate(x, input_ids))


class V3Gate(nn.Module):
    """V3 router: sigmoid scores, bias-steered selection limited to the top ``topk_group``
    of ``n_group`` expert groups (a group scores as the sum of its two best experts)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk: bool,
        route_scale: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk, self.route_scale = norm_topk, route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = s + self.bias.float()
        t, e = choice.shape
        groups = choice.view(t, self.n_group, e // self.n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
        gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(e // self.n_group, dim=1), -torch.inf)
        idx = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        w = s.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, (w * self.route_scale).to(x.dtype)


class V3MoE(RoutedMoE):
    def __init__(
        self,
        dim: int,
        inter: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk: bool,
        route_scale: float,
        n_shared: int,
        parallel: ModelParallel = SINGLE,
        quant: QuantMethods | None = None,
    ) -> None:
        q = quant or QuantMethods()
        super().__init__(
            V3Gate(dim, num_experts, top_k, n_group, topk_group, norm_topk, route_scale),
            Experts(num_experts, dim, inter, parallel=parallel, quant=q.experts),
            SwiGLU(dim, inter * n_shared, group=parallel.tp, reduce=False, quant=q.linear),
            parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._routed(x, *self.gate(x))
