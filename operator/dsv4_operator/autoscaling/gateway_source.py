"""The default metrics source: every gateway replica's ``/metrics`` and ``/instances``.

The gateway already scrapes every engine (waiting, running, KV usage, prompt and prefix-cache
token counters per DP rank) and measures latency as the client sees it (vLLM's histogram
names). Each tick the operator keeps one snapshot per gateway pod; the window's quantiles come
from the bucket differences summed over pods, the token rates from the engines' counters.
Parsing and window arithmetic are pure; fetching is the loop's business.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dsv4_operator.autoscaling.histogram import Buckets, count, delta, quantile
from dsv4_operator.autoscaling.policy import ROLES, Role
from dsv4_operator.autoscaling.signals import Observations, RoleSignals

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
QUANTILE = 0.9


@dataclass(frozen=True)
class EngineLoad:
    """One engine instance as a gateway reports it (summed over its DP ranks)."""

    url: str
    role: str
    healthy: bool
    waiting: float = 0.0
    waiting_for_kv: float = 0.0
    """Of ``waiting``, decode requests parked until their KV is pulled."""
    running: float = 0.0
    kv_usage: float = 0.0
    prompt_tokens: float = 0.0
    """Cumulative prompt tokens (vllm:prompt_tokens_total)."""
    cached_tokens: float = 0.0
    """Cumulative prompt tokens served from the prefix cache (vllm:prefix_cache_hits_total)."""
    inflight_tokens: float = 0.0
    """Uncached prompt tokens this gateway pod has in flight at the engine (for prefill: prompts
    being prefilled or queued there). Counted at arrival, not when processed."""


@dataclass(frozen=True)
class Snapshot:
    at: float
    histograms: dict[str, dict[float, float]]
    engines: tuple[EngineLoad, ...] = ()


def parse_histograms(
    text: str, names: Iterable[str] = (TTFT, ITL)
) -> dict[str, dict[float, float]]:
    """Cumulative ``_bucket`` counts per ``le`` (summed over other labels) of each histogram."""
    wanted = set(names)
    out: dict[str, dict[float, float]] = {n: {} for n in wanted}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for s in family.samples:
            if s.name != family.name + "_bucket":
                continue
            le = float(s.labels["le"])
            out[family.name][le] = out[family.name].get(le, 0.0) + float(s.value)
    return out


def parse_instances(doc: Sequence[Mapping[str, Any]]) -> tuple[EngineLoad, ...]:
    """The gateway's ``/instances`` answer: one entry per engine, with per-rank loads."""
    loads = []
    for inst in doc:
        ranks = inst.get("ranks") or [{}]

        def total(key: str, ranks: Sequence[Mapping[str, Any]] = ranks) -> float:
            return float(sum(float(r.get(key, 0.0)) for r in ranks))

        loads.append(
            EngineLoad(
                url=str(inst["url"]),
                role=str(inst["role"]),
                healthy=bool(inst.get("healthy", True)),
                waiting=total("waiting"),
                waiting_for_kv=total("waiting_for_kv"),
                running=total("running"),
                kv_usage=total("kv_usage") / max(len(ranks), 1),
                prompt_tokens=total("prompt_tokens"),
                cached_tokens=total("cached_tokens"),
                inflight_tokens=total("inflight_tokens"),
            )
        )
    return tuple(loads)


@dataclass(frozen=True)
class RoleCounts:
    """What Kubernetes says about a role's instances (the operator's own observation)."""

    ready: int
    starting: int = 0
    draining: int = 0
    blocked: int = 0


@dataclass
class GatewayWindow:
    """Snapshots per gateway pod over the window; ``observations`` turns them into one tick."""

    window_s: float
    recent_s: float | None = None
    """Also a prompt-token rate over about this long (the newest snapshots): a step in the
    load shows there within a few ticks, where the window's average lags by half the window."""
    snapshots: dict[str, list[Snapshot]] = field(default_factory=dict)

    def add(self, pod: str, snap: Snapshot) -> None:
        ring = self.snapshots.setdefault(pod, [])
        ring.append(snap)
        # keep the newest snapshot at least window_s old as the window's start
        while len(ring) > 2 and snap.at - ring[1].at >= self.window_s:
            ring.pop(0)

    def forget(self, live_pods: Iterable[str]) -> None:
        """Drop gateway pods that are gone (their series would read as stale forever)."""
        live = set(live_pods)
        for pod in list(self.snapshots):
            if pod not in live:
                del self.snapshots[pod]

    def _recent_start(self, last: Snapshot) -> Snapshot | None:
        """The oldest snapshot of ``last``'s pod within ``recent_s`` of it (None: no such pair)."""
        if self.recent_s is None:
            return None
        for ring in self.snapshots.values():
            if ring and ring[-1] is last:
                for s in ring:
                    if s is not last and last.at - s.at <= self.recent_s:
                        return s
        return None

    def observations(self, counts: Mapping[Role, RoleCounts]) -> Observations | None:
        pairs = [(ring[0], ring[-1]) for ring in self.snapshots.values() if ring]
        if not pairs:
            return None
        newest = max(pairs, key=lambda p: p[1].at)
        observed_at = min(new.at for _, new in pairs)  # the stalest pod bounds freshness
        hist = {name: _window_sum(pairs, name) for name in (TTFT, ITL)}
        first, last = newest
        recent = self._recent_start(last)
        latest = [new for _, new in pairs if new.engines]
        roles: dict[Role, RoleSignals] = {}
        for role in ROLES:
            now_loads = [e for e in last.engines if e.role == role and e.healthy]
            # every gateway pod routes its own requests: their in-flight prompts add up
            backlog = sum(
                e.inflight_tokens for s in latest for e in s.engines if e.role == role and e.healthy
            )
            c = counts[role]
            roles[role] = RoleSignals(
                ready=c.ready,
                starting=c.starting,
                draining=c.draining,
                blocked=c.blocked,
                waiting=sum(max(0.0, e.waiting - e.waiting_for_kv) for e in now_loads),
                running=sum(e.running for e in now_loads),
                kv_usage=sum(e.kv_usage for e in now_loads),
                prompt_tokens_per_s=_uncached_rate(first, last, now_loads),
                prompt_tokens_per_s_recent=(
                    _uncached_rate(recent, last, now_loads) if recent is not None else None
                ),
                backlog_tokens=backlog if latest else None,
            )
        return Observations(
            observed_at=observed_at,
            roles=roles,
            ttft_p90=quantile(QUANTILE, hist[TTFT]),
            tpot_p90=quantile(QUANTILE, hist[ITL]),
            requests=int(count(hist[TTFT])),
        )


def _uncached_rate(first: Snapshot, last: Snapshot, loads: Sequence[EngineLoad]) -> float:
    """Uncached prompt tokens per second of ``loads`` (engines of ``last``) since ``first``."""
    span = last.at - first.at
    if span <= 0:
        return 0.0
    before = {e.url: e for e in first.engines}
    rate = 0.0
    for e in loads:
        b = before.get(e.url)
        if b is None or e.prompt_tokens < b.prompt_tokens:
            continue  # new or restarted engine: no rate yet
        uncached = (e.prompt_tokens - e.cached_tokens) - (b.prompt_tokens - b.cached_tokens)
        rate += max(0.0, uncached) / span
    return rate


def _window_sum(pairs: Sequence[tuple[Snapshot, Snapshot]], name: str) -> dict[float, float]:
    total: dict[float, float] = {}
    for old, new in pairs:
        if old is new:
            continue  # one snapshot is a point, not a window
        new_b: Buckets = new.histograms.get(name, {})
        for le, c in delta(new_b, old.histograms.get(name)).items():
            total[le] = total.get(le, 0.0) + c
    if total and math.inf not in total:
        total[math.inf] = max(total.values())
    return total
