"""What the gateway knows of each upstream engine: health, its own in-flight accounting, the
engine's scraped load, and which prompt prefixes it has recently been given."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from dsv4_serving.gateway.kv_index import RankCache

Role = Literal["prefill", "decode", "both"]


class PrefixIndex:
    """Recently routed block hashes (bounded LRU): an estimate of the engine's prefix cache."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of a prompt this instance probably still has cached."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._hashes)


@dataclass
class RankLoad:
    """Load of one data-parallel rank of an instance."""

    inflight_requests: int = 0
    inflight_tokens: int = 0
    waiting: float = 0.0  # vllm:num_requests_waiting, scraped
    # of those, decode requests parked with their blocks until their KV is pulled (scraped
    # dsv4_kv_requests_waiting_for_remote_kv): they wait for the KV, not for this engine
    waiting_for_kv: float = 0.0
    running: float = 0.0  # vllm:num_requests_running, scraped
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, scraped (0..1)
    # cumulative counters, scraped: the autoscaler's uncached prompt-token rate comes from them
    prompt_tokens: float = 0.0  # vllm:prompt_tokens_total
    cached_tokens: float = 0.0  # vllm:prefix_cache_hits_total


@dataclass
class Instance:
    url: str
    role: Role
    dp_size: int = 1
    healthy: bool = True
    draining: bool = False
    """It answered X-DSV4-Draining (shutting down): no new requests until its /ready is 200."""
    failures: int = 0
    routed: int = 0
    ranks: list[RankLoad] = field(default_factory=list)
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    kv_events: str | None = None
    """The engine's ``--kv-events-endpoint`` (DP rank r: ``rank_endpoints``); None: no events."""
    kv_ranks: list[RankCache] | None = None
    """Per DP rank, what its KV events say it caches (set once its events are subscribed)."""
    revision: str = ""
    """The deployment revision it runs (the operator's routing ConfigMap; "" when unknown):
    prefill and decode are paired within one revision only (``policies.paired_revisions``)."""

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if not self.ranks:
            self.ranks = [RankLoad() for _ in range(self.dp_size)]

    @property
    def inflight_requests(self) -> int:
        return sum(r.inflight_requests for r in self.ranks)

    def begin(self, rank: int, tokens: int) -> None:
        self.routed += 1
        self.ranks[rank].inflight_requests += 1
        self.ranks[rank].inflight_tokens += tokens

    def end(self, rank: int, tokens: int) -> None:
        r = self.ranks[rank]
        r.inflight_requests = max(0, r.inflight_requests - 1)
        r.inflight_tokens = max(0, r.inflight_tokens - tokens)

    @contextmanager
    def held(self, rank: int, tokens: int) -> Iterator[None]:
        """One upstream call's share of this instance's load, for as long as the block runs."""
        self.begin(rank, tokens)
        try:
            yield
        finally:
            self.end(rank, tokens)


class InstancePool:
    """All known instances, by URL; discovery adds and removes, health checks eject and re-admit."""

    def __init__(self) -> None:
        self._by_url: dict[str, Instance] = {}
        self.newest_revision = ""
        """The revision the operator rolls to: preferred while it has a prefill-decode pair."""

    def set_members(
        self,
        role: Role,
        urls: Iterable[str],
        dp_size: int = 1,
        revisions: Mapping[str, str] | None = None,
    ) -> None:
        """Make the instances of ``role`` exactly ``urls``, keeping state of those that stay;
        ``revisions``: each URL's revision (absent: unknown, "")."""
        wanted = {u.rstrip("/") for u in urls}
        for url in [u for u, i in self._by_url.items() if i.role == role and u not in wanted]:
            del self._by_url[url]
        for url in sorted(wanted):
            revision = (revisions or {}).get(url, "")
            known = self._by_url.get(url)
            # another revision at a known address is another engine: a fresh Instance, and the
            # requests already routed keep the revision they were paired under
            if known is None or known.revision != revision:
                self._by_url[url] = Instance(url=url, role=role, dp_size=dp_size, revision=revision)

    def all(self) -> list[Instance]:
        return list(self._by_url.values())

    def of_role(self, role: Role, healthy_only: bool = True) -> list[Instance]:
        """The instances of ``role``; with ``healthy_only``, those new requests may go to."""
        return [
            i
            for i in self._by_url.values()
            if i.role == role and ((i.healthy and not i.draining) or not healthy_only)
        ]

    def get(self, url: str) -> Instance | None:
        return self._by_url.get(url.rstrip("/"))
