"""What the scheduler side hands the worker side each step, and what comes back (as vLLM's
``KVConnectorMetadata`` and ``KVConnectorOutput``). Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class LoadSpec:
    """Pull the KV named by ``params`` into ``block_ids`` / ``state_slot`` of a decode request."""

    request_id: str
    params: dict[str, Any]  # the decode request's kv_transfer_params (RemotePrefillParams)
    block_ids: list[int]  # allocated for the whole prompt (+ lookahead)
    state_slot: int
    num_tokens: int  # tokens of KV to import (the prompt's)


@dataclass(slots=True)
class SaveSpec:
    """Export a finished prefill's KV (its first ``num_tokens`` tokens) for a remote decode."""

    request_id: str
    block_ids: list[int]
    state_slot: int
    num_tokens: int
    prompt_token_ids: list[int]
    first_token: int | None


@dataclass(slots=True)
class KVConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # loads whose request went away


@dataclass(slots=True)
class KVLoadFailure:
    reason: str  # auth, timeout, unknown_transfer, connection, incompatible, sidecar, ...
    message: str

    @property
    def always_fails(self) -> bool:
        """A layout mismatch is a deployment error: never recomputed around silently."""
        return self.reason == "incompatible"


@dataclass(slots=True)
class KVConnectorOutput:
    """Loads that finished since the last step (the KV is in the request's blocks)."""

    loaded: list[str] = field(default_factory=list)
    failed: dict[str, KVLoadFailure] = field(default_factory=dict)
    pull_seconds: list[float] = field(default_factory=list)
    bytes_pulled: int = 0
