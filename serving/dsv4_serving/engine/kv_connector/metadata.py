"""The data the two connector sides and the core exchange (as vLLM's ``KVConnectorMetadata``,
``KVConnectorOutput`` and ``KVConnectorStats``). Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4_kvtransfer.integrity import CHECKSUM_MISMATCH, FINGERPRINT_MISMATCH
from dsv4_kvtransfer.pd_protocol import PrefixPullParams, RemotePrefillParams

INTEGRITY_REASONS = frozenset({FINGERPRINT_MISMATCH, CHECKSUM_MISMATCH})


@dataclass(slots=True)
class LoadSpec:
    """Pull the KV named by ``params`` into ``block_ids`` / ``state_slot`` of a decode request;
    or, for a prefix pull (``prefix``), the host tier's entry of the prompt's first
    ``num_tokens`` tokens into the blocks after the ``first_block`` the local cache had."""

    request_id: str
    params: RemotePrefillParams | None  # None: a prefix pull (params built from ``prefix``)
    block_ids: list[int]  # allocated for the whole prompt (+ lookahead); a prefix pull's: to load
    state_slot: int
    num_tokens: int  # tokens of KV to import (the prompt's, or the prefix's)
    prefix: PrefixPullParams | None = None
    first_block: int = 0  # a prefix pull: blocks the local cache had (not loaded again)
    token_ids: list[int] = field(default_factory=list)  # a prefix pull: the prefix's tokens


@dataclass(slots=True)
class SaveSpec:
    """Export a finished prefill's KV (its first ``num_tokens`` tokens) for a remote decode."""

    request_id: str
    block_ids: list[int]
    state_slot: int
    num_tokens: int
    prompt_token_ids: list[int]
    first_token: int | None
    prefix_key: str | None = None  # an offer to the host tier under this key (no response)


@dataclass(slots=True)
class KVConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # loads whose request went away


@dataclass(slots=True)
class KVTransferFailure:
    """Why a pull (decode) or an export (prefill) failed."""

    reason: str  # auth, timeout, unknown_transfer, connection, incompatible, export_failed,
    # fingerprint_mismatch, checksum_mismatch (``dsv4_kvtransfer.integrity``), ...
    message: str

    @property
    def always_fails(self) -> bool:
        """A layout mismatch is a deployment error: never recomputed around silently."""
        return self.reason == "incompatible"

    @property
    def always_recomputes(self) -> bool:
        """KV refused by its integrity check (another layout or revision, bytes changed on
        the way): the request itself is fine, so its prompt is recomputed whatever the
        failure policy (counted by reason like every failed pull)."""
        return self.reason in INTEGRITY_REASONS


@dataclass(slots=True)
class KVConnectorOutput:
    """Loads that finished since the last step (the KV is in the request's blocks)."""

    loaded: list[str] = field(default_factory=list)
    # (block ids, state slot) each of ``loaded`` was copied into: TP followers copy the same
    loaded_kv: list[tuple[list[int], int]] = field(default_factory=list)
    failed: dict[str, KVTransferFailure] = field(default_factory=dict)
    pull_seconds: list[float] = field(default_factory=list)
    bytes_pulled: int = 0


@dataclass(slots=True)
class KVConnectorStats:
    """Counters of the engine's KV transfers, shipped to the front end with the scheduler
    stats."""

    num_waiting_for_remote_kv: int = 0
    pulls_ok: int = 0
    pull_failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    recomputes: int = 0  # failed pulls prefilled locally (policy recompute)
    exports_ok: int = 0
    export_failures: int = 0
    bytes_pulled: int = 0
    bytes_exported: int = 0
    # prefix pulls from a host tier: prompt tokens loaded instead of computed, and tokens a
    # failed or refused pull left to compute; offers of finished prefixes to our host tier
    prefix_pulls_ok: int = 0
    prefix_pulled_tokens: int = 0
    prefix_recomputed_tokens: int = 0
    prefix_offers: int = 0
    # observations since the last take() (histograms)
    pull_seconds: list[float] = field(default_factory=list)
    export_seconds: list[float] = field(default_factory=list)

    def take(self) -> KVConnectorStats:
        """A copy for the front end; the observations move with it (each is sent once)."""
        out = KVConnectorStats(
            num_waiting_for_remote_kv=self.num_waiting_for_remote_kv,
            pulls_ok=self.pulls_ok,
            pull_failures=dict(self.pull_failures),
            recomputes=self.recomputes,
            exports_ok=self.exports_ok,
            export_failures=self.export_failures,
            bytes_pulled=self.bytes_pulled,
            bytes_exported=self.bytes_exported,
            prefix_pulls_ok=self.prefix_pulls_ok,
            prefix_pulled_tokens=self.prefix_pulled_tokens,
            prefix_recomputed_tokens=self.prefix_recomputed_tokens,
            prefix_offers=self.prefix_offers,
            pull_seconds=self.pull_seconds,
            export_seconds=self.export_seconds,
        )
        self.pull_seconds, self.export_seconds = [], []
        return out
