"""Routing scorers: each says what one (instance, DP rank) would cost a request, in one unit
(prompt tokens of work for prefill, running sequences for decode); the ``dplb`` policy adds
them with the weights of ``--scorers`` and picks the cheapest (llm-d's scorer split).

- ``load``: the work already queued there (the gateway's own in-flight count, and what the
  engine reports: waiting, running, KV usage), as the single formula before it did;
- ``precise_prefix``: minus the prompt tokens the rank would serve from its cache, from the
  engine's KV events (``kv_index.py``), up to the deepest state snapshot; 0 for engines
  without events;
- ``estimated_prefix``: the same from the gateway's memory of what it routed where
  (``instances.PrefixIndex``), for engines without events only.
- ``prefix_pull``: minus what pulling the deepest prefix of the prompt some sidecar's host
  tier holds would save the rank (``prefix_pull.pull_saving``: the tokens beyond its own
  cached prefix, less the pull's time), so an idle instance that can pull competes with a
  busy holder; 0 without host-tier entries or with pulls off.

Prefix scorers count for prefill (and engines that do both); decode gets its KV with the
request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from dsv4_serving.gateway.instances import Instance
from dsv4_serving.gateway.prefix_pull import HostPrefix, PullCosts, pull_saving


@dataclass(frozen=True)
class RouteRequest:
    """What is being routed: the prompt's size and prefix, and the stage."""

    prompt_tokens: int
    block_hashes: Sequence[bytes] = ()
    block_size: int = 16
    stage: Literal["prefill", "decode"] = "prefill"
    # the prompt's token ids (their first block_size * len(block_hashes) at least): a
    # snapshot keyed by the token after a boundary is looked up with it
    token_ids: Sequence[int] = ()
    # decode after a prefill: the prefill instance's revision, the only one it may pair with
    # (None: any, as for a decode-only request)
    revision: str | None = None
    # prefixes of the prompt in sidecars' host tiers (the gateway's index), and what a pull
    # costs (None: pulls off)
    host_prefixes: Sequence[HostPrefix] = ()
    pull_costs: PullCosts | None = None


Scorer = Callable[[Instance, int, RouteRequest], float]

# how much an engine-reported waiting request weighs, in prompt tokens / in running sequences
WAITING_TOKENS = 256.0
KV_PRESSURE = 8.0


def load(inst: Instance, rank: int, req: RouteRequest) -> float:
    r = inst.ranks[rank]
    if req.stage == "prefill":
        return r.inflight_tokens + req.prompt_tokens + r.waiting * WAITING_TOKENS
    # the gateway's own count reacts at once; the scraped one catches other clients
    pressure = KV_PRESSURE * max(0.0, r.kv_usage - 0.8) / 0.2
    return max(r.inflight_requests, r.running) + r.waiting + pressure


def precise_cached(inst: Instance, rank: int, req: RouteRequest) -> int:
    """Prompt tokens the rank's KV events say it would serve from cache."""
    if inst.kv_ranks is None or not req.block_hashes:
        return 0
    return inst.kv_ranks[rank].usable_tokens(req.block_hashes, req.token_ids, req.block_size)


def estimated_cached(inst: Instance, rank: int, req: RouteRequest) -> int:
    """The gateway's estimate, for an instance without KV events."""
    if inst.kv_ranks is not None:
        return 0
    blocks = inst.prefix.matched_blocks(req.block_hashes)
    return min(blocks * req.block_size, req.prompt_tokens)


def cached_tokens(inst: Instance, rank: int, req: RouteRequest) -> int:
    """The best knowledge of the rank's cached prompt tokens: events if it has them."""
    if inst.kv_ranks is not None:
        return precise_cached(inst, rank, req)
    return estimated_cached(inst, rank, req)


def precise_prefix(inst: Instance, rank: int, req: RouteRequest) -> float:
    return -precise_cached(inst, rank, req) if req.stage == "prefill" else 0.0


def estimated_prefix(inst: Instance, rank: int, req: RouteRequest) -> float:
    return -estimated_cached(inst, rank, req) if req.stage == "prefill" else 0.0


def prefix_pull(inst: Instance, rank: int, req: RouteRequest) -> float:
    if req.stage != "prefill" or req.pull_costs is None or not req.host_prefixes:
        return 0.0
    return -pull_saving(cached_tokens(inst, rank, req), req.host_prefixes, req.pull_costs)


SCORERS: dict[str, Scorer] = {
    "load": load,
    "precise_prefix": precise_prefix,
    "estimated_prefix": estimated_prefix,
    "prefix_pull": prefix_pull,
}
DEFAULT_WEIGHTS = "load=1,precise_prefix=1,estimated_prefix=1,prefix_pull=1"


def parse_weights(spec: str) -> dict[str, float]:
    """``name=weight,...`` -> weights; ValueError naming an unknown scorer or a bad weight."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r}; choose from {', '.join(SCORERS)}")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(f"scorer {name}: weight {value!r} is not a number") from None
        if weight < 0:
            raise ValueError(f"scorer {name}: weight must be >= 0, got {weight}")
        out[name] = weight
    if not out:
        raise ValueError("--scorers names no scorer")
    return out


def cost(inst: Instance, rank: int, req: RouteRequest, weights: Mapping[str, float]) -> float:
    return sum(w * SCORERS[name](inst, rank, req) for name, w in weights.items() if w)
