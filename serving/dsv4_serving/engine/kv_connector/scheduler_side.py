"""The scheduler side of the sidecar connector: pure bookkeeping, no I/O.

A decode imports every exported token and then recomputes the last prompt token, as vLLM does,
so its first step produces the logits of the first output token exactly as a local prefill's
last chunk would. A prefill's blocks are freed as soon as its export ended (it runs beside the
next engine steps): the staging copy lives under the sidecar's lease, so an engine never leaks
blocks to a decode that does not come.
"""

from __future__ import annotations

from typing import Literal

from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, RemotePrefillParams
from dsv4_serving.engine.kv_connector.base import KVConnectorScheduler
from dsv4_serving.engine.kv_connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorStats,
    KVTransferFailure,
    LoadSpec,
    SaveSpec,
)
from dsv4_serving.engine.request import Request, RequestStatus

FailurePolicy = Literal["fail", "recompute"]


def wants_remote_decode(req: Request) -> bool:
    return isinstance(req.kv_transfer_params, PrefillRequestParams)


def wants_remote_prefill(req: Request) -> bool:
    return isinstance(req.kv_transfer_params, RemotePrefillParams)


class SidecarConnectorScheduler(KVConnectorScheduler):
    def __init__(self, failure_policy: FailurePolicy = "recompute") -> None:
        self.failure_policy = failure_policy
        self.stats = KVConnectorStats()
        self._loading: set[str] = set()  # parked, load started or due
        self._meta = KVConnectorMetadata()
        self._saves: list[SaveSpec] = []

    def get_num_new_matched_tokens(self, req: Request) -> int | None:
        if not wants_remote_prefill(req) or req.kv_load_failed:
            return None
        # every prompt token's KV arrives; the last one is computed again for its logits
        return req.num_prompt_tokens - 1

    def update_state_after_alloc(self, req: Request, block_ids: list[int], slot: int) -> None:
        params = req.kv_transfer_params
        assert isinstance(params, RemotePrefillParams)
        self._loading.add(req.request_id)
        self._meta.loads.append(
            LoadSpec(req.request_id, params, list(block_ids), slot, req.num_prompt_tokens)
        )

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        self.stats.num_waiting_for_remote_kv = len(self._loading)
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in out.loaded:
            self._loading.discard(rid)
        self.stats.pulls_ok += len(out.loaded)
        self.stats.pull_seconds.extend(out.pull_seconds)
        self.stats.bytes_pulled += out.bytes_pulled
        for rid, f in out.failed.items():
            self._loading.discard(rid)
            self.stats.pull_failures[f.reason] = self.stats.pull_failures.get(f.reason, 0) + 1
        self.stats.num_waiting_for_remote_kv = len(self._loading)

    def on_load_failed(self, req: Request, failure: KVTransferFailure) -> bool:
        if self.failure_policy == "recompute" and not failure.always_fails:
            req.kv_load_failed = True
            self.stats.recomputes += 1
            return True
        return False

    def request_finished(
        self, req: Request, status: RequestStatus, block_ids: list[int], slot: int | None
    ) -> bool:
        rid = req.request_id
        if rid in self._loading:  # aborted while its KV was on the way
            self._loading.discard(rid)
            self._meta.cancelled.append(rid)
            self.stats.num_waiting_for_remote_kv = len(self._loading)
        if slot is None or not block_ids:
            return False
        if status == RequestStatus.FINISHED_MIGRATED:
            # a drain moves a running sequence: its KV up to its last forwarded token (the
            # last sampled one is recomputed by whoever continues), hashed with every token
            ids = list(req.all_token_ids)
            self._saves.append(SaveSpec(rid, list(block_ids), slot, len(ids) - 1, ids, None))
            return True
        if status == RequestStatus.FINISHED_ABORTED or not wants_remote_decode(req):
            return False
        n = req.num_prompt_tokens
        first = req.all_token_ids[n] if req.num_output_tokens else None
        self._saves.append(
            SaveSpec(rid, list(block_ids), slot, n, req.all_token_ids[:n], first_token=first)
        )
        return True

    def take_saves(self) -> list[SaveSpec]:
        out, self._saves = self._saves, []
        return out
