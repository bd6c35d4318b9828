"""The two interfaces of a KV connector (the story is in this package's ``__init__``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_serving.engine.kv_connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorStats,
    KVTransferFailure,
    SaveSpec,
)
from dsv4_serving.engine.request import Request, RequestStatus


class KVConnectorScheduler(ABC):
    stats: KVConnectorStats
    offers_prefixes: bool
    """Finished requests' prefixes go to our sidecar's host tier (``offer``)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, req: Request) -> int | None:
        """Tokens of ``req``'s prompt whose KV will arrive from elsewhere (loaded
        asynchronously: the request waits, parked, until it has); None for a local request."""

    @abstractmethod
    def update_state_after_alloc(
        self, req: Request, block_ids: list[int], slot: int, first_block: int = 0
    ) -> None:
        """Blocks and slot were allocated for a request that loads remote KV: load into them
        (a prefix pull: into ``block_ids``, its blocks after the ``first_block`` cached ones)."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """What the worker side must start (or cancel) now; resets the pending lists."""

    @abstractmethod
    def update_connector_output(self, out: KVConnectorOutput) -> None:
        """Account for loads the worker side finished."""

    @abstractmethod
    def on_load_failed(self, req: Request, failure: KVTransferFailure) -> bool:
        """A load failed: True to prefill the request locally instead (the failure policy)."""

    @abstractmethod
    def request_finished(
        self, req: Request, status: RequestStatus, block_ids: list[int], slot: int | None
    ) -> bool:
        """``req`` finished: True to keep its blocks and slot until its KV was saved
        (``take_saves`` / the worker's ``start_save_kv``), False to free them now."""

    @abstractmethod
    def prefix_not_pulled(self, num_tokens: int) -> None:
        """A prefix pull's tokens are computed here after all (refused or failed)."""

    @abstractmethod
    def offer(
        self, req: Request, block_ids: list[int], slot: int | None, num_tokens: int, key: str
    ) -> None:
        """Save finished ``req``'s first ``num_tokens`` tokens to our host tier under ``key``."""

    @abstractmethod
    def take_saves(self) -> list[SaveSpec]:
        """Saves due since the last call."""


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_caches(self, cache: Any) -> None:
        """The model's cache object (``paged`` and ``state`` tensors)."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Start the loads of ``meta`` (asynchronously) and cancel those it names."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Loads finished since the last call; successful ones are already in their blocks."""

    @abstractmethod
    def start_save_kv(self, saves: list[SaveSpec], traceparents: dict[str, str | None]) -> None:
        """Start exporting each request's KV (asynchronously: its blocks and slot stay
        allocated until ``get_finished_saves`` returned it); ``traceparents``: the span each
        export's sidecar calls belong to (tracing on)."""

    @abstractmethod
    def get_finished_saves(self) -> dict[str, RemotePrefillParams | KVTransferFailure]:
        """Exports finished since the last call: each request's ``kv_transfer_params`` or why
        it failed."""

    @abstractmethod
    def wait_for_event(self, timeout_s: float) -> None:
        """Block until a load or a save finishes or ``timeout_s`` passes (an idle engine's
        wait)."""

    @abstractmethod
    def close(self) -> None: ...
