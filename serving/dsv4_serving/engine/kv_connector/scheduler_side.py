"""The scheduler side of the sidecar connector: pure bookkeeping, no I/O.

A decode imports every exported token and then recomputes the last prompt token, as vLLM does,
so its first step produces the logits of the first output token exactly as a local prefill's
last chunk would. A prefill's blocks are freed as soon as its export ended (it runs beside the
next engine steps): the staging copy lives under the sidecar's lease, so an engine never leaks
blocks to a decode that does not come.

A prefix pull (``PrefixPullParams``) loads a prompt's first blocks and the state snapshot at
their end from a sidecar's host tier, then the request computes the rest as any prompt; it is
an optimisation, so a failed one is always recomputed. A finished request's deepest
snapshotted prefix is offered to our own sidecar's host tier (``offer``) when it has one.
"""

from __future__ import annotations

from typing import Literal

from dsv4_kvtransfer.pd_protocol import (
    PrefillRequestParams,
    RemotePrefillParams,
    prefix_pull_of,
)
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
        self._prefix_loading: dict[str, int] = {}  # prefix pulls among them: tokens to load
        self._meta = KVConnectorMetadata()
        self._saves: list[SaveSpec] = []
        self.offers_prefixes = False  # our sidecar has a host tier (the worker side asks it)

    def get_num_new_matched_tokens(self, req: Request) -> int | None:
        if req.kv_load_failed:
            return None
        pull = prefix_pull_of(req.kv_transfer_params)
        if pull is not None:
            return pull.num_tokens
        if not wants_remote_prefill(req):
            return None
        # every prompt token's KV arrives; the last one is computed again for its logits
        return req.num_prompt_tokens - 1

    def update_state_after_alloc(
        self, req: Request, block_ids: list[int], slot: int, first_block: int = 0
    ) -> None:
        """A prefix pull's ``block_ids`` are the blocks to load, after the ``first_block`` ones
        the local cache had."""
        params = req.kv_transfer_params
        rid = req.request_id
        self._loading.add(rid)
        pull = prefix_pull_of(params)
        if pull is not None:
            # tokens loaded: the pulled blocks' share of the prefix (the local hit's are not)
            loaded = pull.num_tokens * len(block_ids) // (first_block + len(block_ids))
            self._prefix_loading[rid] = loaded
            self._meta.loads.append(
                LoadSpec(
                    rid,
                    None,
                    list(block_ids),
                    slot,
                    pull.num_tokens,
                    prefix=pull,
                    first_block=first_block,
                    token_ids=req.all_token_ids[: pull.num_tokens],
                )
            )
            return
        assert isinstance(params, RemotePrefillParams)
        self._meta.loads.append(LoadSpec(rid, params, list(block_ids), slot, req.num_prompt_tokens))

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        self.stats.num_waiting_for_remote_kv = len(self._loading)
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in out.loaded:
            self._loading.discard(rid)
            tokens = self._prefix_loading.pop(rid, None)
            if tokens is not None:
                self.stats.prefix_pulls_ok += 1
                self.stats.prefix_pulled_tokens += tokens
        self.stats.pulls_ok += len(out.loaded)
        self.stats.pull_seconds.extend(out.pull_seconds)
        self.stats.bytes_pulled += out.bytes_pulled
        for rid, f in out.failed.items():
            self._loading.discard(rid)
            self.stats.pull_failures[f.reason] = self.stats.pull_failures.get(f.reason, 0) + 1
        self.stats.num_waiting_for_remote_kv = len(self._loading)

    def on_load_failed(self, req: Request, failure: KVTransferFailure) -> bool:
        tokens = self._prefix_loading.pop(req.request_id, None)
        if tokens is not None:  # a prefix is only an optimisation: always computed instead
            self.prefix_not_pulled(tokens)
            return True
        if (
            self.failure_policy == "recompute" or failure.always_recomputes
        ) and not failure.always_fails:
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
            self._prefix_loading.pop(rid, None)
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

    def prefix_not_pulled(self, num_tokens: int) -> None:
        """A prefix pull's tokens will be computed here after all (refused or failed)."""
        self.stats.prefix_recomputed_tokens += num_tokens

    def offer(
        self, req: Request, block_ids: list[int], slot: int | None, num_tokens: int, key: str
    ) -> None:
        """Export finished ``req``'s first ``num_tokens`` tokens (``block_ids``, the state
        snapshot at their end in ``slot``) to our sidecar's host tier under ``key``; its blocks
        and that slot stay held until the save ended. No response waits for it."""
        self.stats.prefix_offers += 1
        self._saves.append(
            SaveSpec(
                req.request_id,
                list(block_ids),
                slot if slot is not None else -1,
                num_tokens,
                req.all_token_ids[:num_tokens],
                first_token=None,
                prefix_key=key,
            )
        )

    def take_saves(self) -> list[SaveSpec]:
        out, self._saves = self._saves, []
        return out
