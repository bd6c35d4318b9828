"""What crosses from the scheduler to the model runner and back each step, and the stats it
keeps: the scheduler's typed contract with the runner and the front end."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4_serving.engine.kv_connector.metadata import KVConnectorStats
from dsv4_serving.engine.request import Logprob
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.eplb.stats import EplbStats


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # this step's inputs: prompt/output tokens, then draft tokens
    context_len: int  # tokens already in the cache
    num_spec: int  # trailing draft tokens in token_ids
    block_ids: list[int]
    state_slot: int
    sample: bool  # the step reaches the request's last known token: sample after it
    next_token: int | None  # token at context_len + len(token_ids) when known (prefill chunk)
    sampling_params: SamplingParams
    num_output_tokens: int  # before this step (for seeded sampling positions)
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (boundary, slot) in-chunk
    # the prompt, sent once, at the first sample of a request whose penalties count tokens
    # (the runner keeps the counts from then on: ``logits_processors.TokenHistory``)
    prompt_token_ids: list[int] | None = None
    # async only: a boundary this step may start at and the slot for its snapshot, copied
    # before the forward if the step starts there (``KVCacheManager.reserve_landing``)
    landing: tuple[int, int | None] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    state_copies: list[tuple[int, int]]  # (src slot, dst slot) before the forward
    finished_ids: list[str]  # requests gone since the last step (runner drops their state)
    num_batched_tokens: int


@dataclass(slots=True)
class RunnerResult:
    """What the model runner produced for one sampled request."""

    token_ids: list[int]  # accepted drafts, then one sampled token
    logprobs: list[Logprob] | None = None
    draft_ids: list[int] = field(default_factory=list)  # drafts for the next step


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_queries: int = 0  # cumulative prompt tokens looked up
    prefix_hits: int = 0  # cumulative prompt tokens found in the cache
    spec_drafts: int = 0  # cumulative verification runs
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    num_preemptions: int = 0
    num_late_prompts: int = 0  # cumulative prompts judged unable to make their prompt deadline
    kv_transfer: KVConnectorStats | None = None  # with a KV connector (PD roles)
    eplb: EplbStats | None = None  # with EPLB (the same on every EP rank)
    # (schedule, prepare, post-process) seconds of each step since the last stats sent
    # (``engine/engine/host_times.py``; the engine core fills it)
    host_spans: list[tuple[float, float, float]] = field(default_factory=list)
