"""Pull or recompute: whether the instance chosen for a prompt should pull a longer prefix
another instance's sidecar host tier holds (``PrefixPullParams``) instead of computing it.
Pure; the inputs are measured elsewhere (the sidecars' transfer histograms, the engines'
step cost).

    gain  = holder's prefix - the chosen instance's own cached prefix      (tokens)
    pull <=> gain >= min_tokens  and
             fixed_s + prefix * bytes_per_token / rate  <  (1 - margin) * gain * prefill_s_per_token

A pull moves the holder's whole entry (``prefix`` tokens: an entry is one export, and the
engine copies only the blocks past its own hit into its cache), so its transfer is charged
for every token of it while only the gain saves compute: a long context whose local hit
already covers nearly all of it is not worth pulling for a short tail. At V4-Flash's 9.8
KB/token and a few GB/s a pull costs 1-4 ms per 1K tokens of entry against tens to hundreds of
milliseconds of prefill per 1K tokens of gain, so it wins unless the gain is a small part of
a long entry; the rule also guards slow paths and tiny gains.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dsv4_kvtransfer.pd_protocol import PREFIX_PULL, PrefixPullParams
from dsv4_serving.gateway.kv_index import RankCache


@dataclass(frozen=True, slots=True)
class PullCosts:
    bytes_per_token: float
    """KV bytes per prompt token (learned from exports: total bytes / tokens)."""
    rate_bytes_s: float
    """Measured transfer rate between sidecars."""
    fixed_s: float = 1e-3
    """A pull's cost besides its bytes (control round trips, manifest)."""
    prefill_s_per_token: float = 1e-4
    """The chosen engine's prefill cost per token (its fitted step cost)."""
    margin: float = 0.2
    """How much cheaper the pull must be: estimates are rough, computing is the safe side."""
    min_tokens: int = 64

    def __post_init__(self) -> None:
        if self.bytes_per_token < 0 or self.rate_bytes_s <= 0 or self.prefill_s_per_token < 0:
            raise ValueError("bytes_per_token >= 0, rate_bytes_s > 0, prefill_s_per_token >= 0")
        if not 0 <= self.margin < 1 or self.fixed_s < 0 or self.min_tokens < 1:
            raise ValueError("margin in [0, 1), fixed_s >= 0, min_tokens >= 1")


def pull_seconds(moved_tokens: int, costs: PullCosts) -> float:
    """A pull of an entry of ``moved_tokens`` tokens (all of them cross the wire)."""
    return costs.fixed_s + moved_tokens * costs.bytes_per_token / costs.rate_bytes_s


def should_pull(gain_tokens: int, costs: PullCosts, moved_tokens: int | None = None) -> bool:
    """Pull an entry of ``moved_tokens`` (default: the gain alone) that spares computing
    ``gain_tokens``."""
    if gain_tokens < costs.min_tokens:
        return False
    moved = gain_tokens if moved_tokens is None else max(moved_tokens, gain_tokens)
    return pull_seconds(moved, costs) < (
        (1 - costs.margin) * gain_tokens * costs.prefill_s_per_token
    )


def pull_saving(own_cached: int, holders: Sequence[HostPrefix], costs: PullCosts) -> float:
    """What a pull saves the instance (prompt tokens of prefill: the gain less the pull's
    time in prefill tokens), 0 when ``choose_pull`` would not pull: the routing scorer
    ``prefix_pull``, so an idle instance that can pull competes with a busy holder."""
    best = max((h.num_tokens for h in holders), default=0)
    gain = best - own_cached
    if not should_pull(gain, costs, best):
        return 0.0
    return gain - pull_seconds(best, costs) / costs.prefill_s_per_token


@dataclass(frozen=True, slots=True)
class HostPrefix:
    """A prefix of the prompt in some instance's sidecar host tier."""

    host: str  # that sidecar's peer address
    port: int
    num_tokens: int
    key: bytes  # its snapshot key


def choose_pull(
    own_cached: int, holders: Sequence[HostPrefix], costs: PullCosts
) -> PrefixPullParams | None:
    """The pull for an instance whose own cache serves ``own_cached`` prompt tokens: the
    deepest holder's prefix when it is worth pulling, else None (ties: the first holder)."""
    best = max(holders, key=lambda h: h.num_tokens, default=None)
    if best is None or not should_pull(best.num_tokens - own_cached, costs, best.num_tokens):
        return None
    return PrefixPullParams(best.host, best.port, best.num_tokens, best.key.hex())


def host_prefixes(
    ranks: Iterable[RankCache], hashes: Sequence[bytes], token_ids: Sequence[int], bs: int
) -> list[HostPrefix]:
    """The prefixes of a prompt the ranks' host tiers hold, with where to pull them from (a
    rank whose events name no ``host_tier`` address is left out)."""
    out: list[HostPrefix] = []
    for cache in ranks:
        if cache.host_tier is None:
            continue
        found = cache.host_prefix(hashes, token_ids, bs)
        if found is None:
            continue
        host, _, port = cache.host_tier.rpartition(":")
        if host and port.isdigit():
            out.append(HostPrefix(host, int(port), found[0], found[1]))
    return out


def with_pull(body: dict[str, Any], pull: PrefixPullParams | None) -> None:
    """Set (or, for None, remove) ``body``'s ``kv_transfer_params.dsv4_prefix_pull``, keeping
    the rest of its params (a new dict: the client's is not changed)."""
    params = body.get("kv_transfer_params")
    params = dict(params) if isinstance(params, dict) else {}
    if pull is None:
        params.pop(PREFIX_PULL, None)
    else:
        params[PREFIX_PULL] = pull.to_dict()
    if params:
        body["kv_transfer_params"] = params
    else:
        body.pop("kv_transfer_params", None)
