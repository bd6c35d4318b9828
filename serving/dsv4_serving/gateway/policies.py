"""Routing policies: pick an instance (and its data-parallel rank) for one request.

``dplb`` (default) adds the weighted costs of ``scorers.py`` for each (instance, rank): the
work already queued there and, for prefill, minus the prompt tokens it has cached (from the
engine's KV events where it publishes them, else the gateway's estimate). Ties rotate, so
equal instances share load evenly instead of piling onto the first.

Pairing (``paired_revisions``): a prefill and a decode instance exchange KV only within one
deployment revision (model, image and engine flags; KV layouts may differ across). A request
goes to the revision the operator rolls to while it has a prefill and a decode instance, else
to the revision with the most such pairs; its decode is chosen within its prefill's revision.
No complete revision: no pair (503), never a mismatched one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from dsv4_serving.gateway import scorers
from dsv4_serving.gateway.instances import Instance
from dsv4_serving.gateway.scorers import RouteRequest

PolicyName = Literal["dplb", "least_load", "round_robin"]


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
    """The weighted sum of ``scorers``' costs (``--scorers``); the cheapest (instance, rank)."""

    name = "dplb"

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        super().__init__()
        self.weights = dict(weights or scorers.parse_weights(scorers.DEFAULT_WEIGHTS))
        # called with every prefill choice (the gateway's predicted-cached-tokens metric)
        self.on_choice: Callable[[RouteRequest, Choice], None] | None = None

    def choose(self, candidates: Sequence[Instance], req: RouteRequest) -> Choice | None:
        slots = [(inst, r) for inst in candidates for r in range(inst.dp_size)]
        if not slots:
            return None
        best: tuple[float, Instance, int] | None = None
        for k in self._order(len(slots), req.stage):
            inst, r = slots[k]
            score = scorers.cost(inst, r, req, self.weights)
            if best is None or score < best[0]:
                best = (score, inst, r)
        assert best is not None
        _, inst, r = best
        cached = scorers.cached_tokens(inst, r, req) if req.stage == "prefill" else 0
        choice = Choice(inst, r, cached)
        if self.on_choice is not None and req.stage == "prefill":
            self.on_choice(req, choice)
        return choice


def paired_revisions(
    prefill: Sequence[Instance], decode: Sequence[Instance], newest: str
) -> list[str]:
    """The revisions with a prefill and a decode instance among these, best first: ``newest``
    (new instances get traffic as soon as they form a pair), then by pairs (the smaller of the
    two counts) descending, then by name (a stable order)."""
    pairs: dict[str, int] = {}
    for rev in {i.revision for i in prefill}:
        n = min(
            sum(1 for i in prefill if i.revision == rev),
            sum(1 for i in decode if i.revision == rev),
        )
        if n:
            pairs[rev] = n
    return sorted(pairs, key=lambda rev: (rev != newest, -pairs[rev], rev))


def make_policy(name: PolicyName, weights: Mapping[str, float] | None = None) -> Policy:
    """``weights``: the ``dplb`` scorers' (default ``scorers.DEFAULT_WEIGHTS``)."""
    policies: dict[str, type[RoundRobin] | type[LeastLoad] | type[DPLB]] = {
        "round_robin": RoundRobin,
        "least_load": LeastLoad,
        "dplb": DPLB,
    }
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(policies)}")
    return DPLB(weights) if name == "dplb" else policies[name]()
