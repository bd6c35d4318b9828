"""Routing policies: pick an instance (and its data-parallel rank) for one request.

``dplb`` (default) scores each (instance, rank) by the work already queued there, as the
gateway counts it itself (requests and tokens in flight) and as the engine reports it (waiting,
running, KV usage); for prefill it subtracts the prompt blocks that instance probably has cached.
Ties rotate, so equal instances share load evenly instead of piling onto the first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from dsv4_serving.gateway.instances import Instance

PolicyName = Literal["dplb", "least_load", "round_robin"]


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    block_hashes: Sequence[bytes] = ()
    block_size: int = 16
    stage: Literal["prefill", "decode"] = "prefill"


@dataclass(frozen=True)
class Choice:
    instance: Instance
    rank: int
    cached_tokens: int = 0


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Choice | None: ...


class _Rotating:
    """Shared tie-breaking: the starting point advances on every decision, separately per stage
    (one counter for prefill and decode would pair p0 with d1 forever)."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    def _order(self, n: int, stage: str) -> list[int]:
        counter = self._counters.setdefault(stage, itertools.count())
        start = next(counter) % n if n else 0
        return [(start + k) % n for k in range(n)]


class RoundRobin(_Rotating):
    name = "round_robin"

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Choice | None:
        slots = [(inst, r) for inst in candidates for r in range(inst.dp_size)]
        if not slots:
            return None
        inst, rank = slots[self._order(len(slots), req.stage)[0]]
        return Choice(inst, rank)


class LeastLoad(_Rotating):
    name = "least_load"

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Choice | None:
        slots = [(inst, r) for inst in candidates for r in range(inst.dp_size)]
        if not slots:
            return None
        best: tuple[float, Instance, int] | None = None
        for k in self._order(len(slots), req.stage):
            inst, r = slots[k]
            load = inst.ranks[r]
            score = load.inflight_requests + load.waiting
            if best is None or score < best[0]:
                best = (score, inst, r)
        assert best is not None
        return Choice(best[1], best[2])


class DPLB(_Rotating):
    """Cost = tokens to compute here (prefill) or sequences to step here (decode)."""

    name = "dplb"
    # how much an engine-reported waiting request weighs, in prompt tokens / in running sequences
    WAITING_TOKENS = 256.0
    KV_PRESSURE = 8.0

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Choice | None:
        slots = [(inst, r) for inst in candidates for r in range(inst.dp_size)]
        if not slots:
            return None
        best: tuple[float, Instance, int, int] | None = None
        for k in self._order(len(slots), req.stage):
            inst, r = slots[k]
            load = inst.ranks[r]
            cached = 0
            if req.stage == "prefill":
                cached = min(
                    inst.prefix.matched_blocks(req.block_hashes) * req.block_size, req.prompt_tokens
                )
                score = (
                    load.inflight_tokens
                    + (req.prompt_tokens - cached)
                    + load.waiting * self.WAITING_TOKENS
                )
            else:
                # the gateway's own count reacts at once; the scraped one catches other clients
                score = (
                    max(load.inflight_requests, load.running)
                    + load.waiting
                    + self.KV_PRESSURE * max(0.0, load.kv_usage - 0.8) / 0.2
                )
            if best is None or score < best[0]:
                best = (score, inst, r, cached)
        assert best is not None
        return Choice(best[1], best[2], best[3])


def make_policy(name: PolicyName) -> Policy:
    policies: dict[str, type[RoundRobin] | type[LeastLoad] | type[DPLB]] = {
        "round_robin": RoundRobin,
        "least_load": LeastLoad,
        "dplb": DPLB,
    }
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(policies)}")
    return policies[name]()
