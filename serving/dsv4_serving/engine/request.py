"""A request inside the engine core, and the messages between front end and core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, PrefixPullParams, RemotePrefillParams
from dsv4_serving.engine.core.prefix_hash import BlockHash, hash_block_tokens
from dsv4_serving.engine.kv_connector.metadata import KVTransferFailure
from dsv4_serving.engine.sample.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, its KV being pulled
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model length
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # e.g. its remote KV could not be had (failure policy fail)
    FINISHED_MIGRATED = "migrate"  # moved to another engine (a drain): its KV exported

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
            RequestStatus.FINISHED_MIGRATED,
        )


@dataclass(slots=True)
class EngineCoreRequest:
    """What the front end sends the core: tokens, not text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    kv_transfer_params: PrefillRequestParams | RemotePrefillParams | PrefixPullParams | None = None
    """vLLM's PD protocol, parsed and checked once at the API edge (the core only asserts)."""
    data_parallel_rank: int | None = None
    """The DP rank to run on (the ``X-data-parallel-rank`` header); None = least loaded."""
    traceparent: str | None = None
    """W3C trace context of the API server's span of this request (tracing on), else None."""


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one request from one step (1..k+1 with speculative decoding)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_token_id: int | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    kv_transfer_params: RemotePrefillParams | None = None  # a prefill's: where its KV is
    error: KVTransferFailure | None = None  # why finish_reason is "error"


class Request:
    """The core's view of one request: its tokens, how many are in the KV cache, its drafts."""

    __slots__ = (
        "_hashed_tokens",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "eos_token_id",
        "kv_load_failed",
        "kv_transfer_params",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_token_id",
    )

    def __init__(self, req: EngineCoreRequest, eos_token_id: int | None) -> None:
        self.request_id = req.request_id
        self.sampling_params = req.sampling_params
        self.arrival_time = req.arrival_time
        self.eos_token_id = eos_token_id
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set at the first schedule
        self.spec_token_ids: list[int] = []
        # async scheduling: tokens a step in flight is sampling, already counted as computed
        # input of the next step (``core/sched/async_scheduler.py``); always 0 when synchronous
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        self._hashed_tokens = 0
        self.stop_token_id: int | None = None
        self.kv_transfer_params = req.kv_transfer_params
        self.kv_load_failed = False  # its remote KV could not be had: computed locally

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extend the chained hashes over every full block of known tokens."""
        while self._hashed_tokens + block_size <= len(self.all_token_ids):
            parent = self.block_hashes[-1] if self.block_hashes else None
            end = self._hashed_tokens + block_size
            self.block_hashes.append(
                hash_block_tokens(parent, self.all_token_ids[self._hashed_tokens : end])
            )
            self._hashed_tokens = end
        return self.block_hashes

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
