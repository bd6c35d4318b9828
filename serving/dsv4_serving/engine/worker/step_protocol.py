"""What the core (TP rank 0) broadcasts to its TP followers over the TP CPU group, once per
loop turn: the step to run, a heartbeat while idle (a follower's collective must never sit
until its timeout), the KV blocks an import just filled on the core (``ReplicateKV``), or the
end. Pickled dataclasses; the follower matches on the class."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_serving.engine.core.sched.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class RunStep:
    out: SchedulerOutput
    mtp_chain: bool | None = None  # decided by the DP ranks together (``ModelRunner.execute``)


@dataclass(frozen=True, slots=True)
class ReplicateKV:
    loads: list[tuple[list[int], int]]  # (block ids, state slot) per finished import


@dataclass(frozen=True, slots=True)
class Heartbeat:
    pass


@dataclass(frozen=True, slots=True)
class StopFollowing:
    pass


ToFollower = RunStep | ReplicateKV | Heartbeat | StopFollowing
