"""The messages between the front end (``AsyncLLM``) and the engine-core process, over two
multiprocessing queues (pickled). One frozen dataclass per kind; each side dispatches with
``match`` and ``assert_never``, so a kind nobody handles is a type error, not a dropped message.
(vLLM tags its msgpack frames with an ``EngineCoreRequestType`` enum; pickled dataclasses carry
their class, which is the tag here.)"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the front end needs to know about the core (sent once, when ready)."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    num_kv_blocks: int
    num_speculative_tokens: int
    architecture: str
    kv_dtype: str = "float32"
    data_parallel_size: int = 1


# ---- front end -> core ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: EngineCoreRequest


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class MigrateRequests:
    """Move these requests to another engine (a drain, ``engine/engine/drain.py``): each ends
    at its next step boundary with ``finish_reason`` ``"migrate"`` and, with a KV connector, the
    export of its KV as ``kv_transfer_params``."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


RankMessage = AddRequest | AbortRequests | MigrateRequests
"""What a DP rank's core applies (its inbox under DP)."""
ToCore = AddRequest | AbortRequests | MigrateRequests | Shutdown


# ---- core -> front end ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class Outputs:
    """One step's outputs (possibly none) and the scheduler's stats after it: the instance's,
    and with DP each rank's (index = DP rank)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    rank_stats: tuple[SchedulerStats, ...] = ()


@dataclass(frozen=True, slots=True)
class Rejected:
    """The core refused a request (e.g. a duplicate id); the front end fails it."""

    request_id: str
    message: str


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The core could not start, or stopped: every request fails with ``message``."""

    message: str


FromCore = Ready | Outputs | Rejected | CoreFailed
