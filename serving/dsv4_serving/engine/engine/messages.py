"""The messages between the front end (``AsyncLLM``) and the engine-core process, over two
multiprocessing queues (pickled). One frozen dataclass per kind; each side dispatches with
``match`` and ``assert_never``, so a kind nobody handles is a type error, not a dropped message.
(vLLM tags its msgpack frames with an ``EngineCoreRequestType`` enum; pickled dataclasses carry
their class, which is the tag here.)"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

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

    def __reduce__(self) -> tuple[Any, ...]:
        # a slotted dataclass pickles ~10x slower than a tuple: at 256 sequences the step's
        # outputs cost the core (and the front end's reader) most of a millisecond per step
        return _unpack_outputs, ([_pack(o) for o in self.outputs], self.stats, self.rank_stats)


_OUTPUT_FIELDS = tuple(f.name for f in fields(EngineCoreOutput))


def _pack(o: EngineCoreOutput) -> tuple[Any, ...]:
    """A decode step's usual output as (id, tokens, cached tokens); any other as all fields."""
    if (
        o.new_logprobs is None
        and o.finish_reason is None
        and o.stop_token_id is None
        and o.kv_transfer_params is None
        and o.error is None
    ):
        return o.request_id, o.new_token_ids, o.num_cached_tokens
    return tuple(getattr(o, f) for f in _OUTPUT_FIELDS)


def _unpack(t: tuple[Any, ...]) -> EngineCoreOutput:
    if len(t) == 3:
        return EngineCoreOutput(t[0], t[1], num_cached_tokens=t[2])
    return EngineCoreOutput(*t)


def _unpack_outputs(
    packed: list[tuple[Any, ...]], stats: SchedulerStats, rank_stats: tuple[SchedulerStats, ...]
) -> Outputs:
    return Outputs([_unpack(t) for t in packed], stats, rank_stats)


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
