"""Which DP rank of the instance takes a new request, and when no rank admits new work.

vLLM's DP load balancing: a request pinned by the ``X-data-parallel-rank`` header (the
gateway's choice) goes there; else to the least-loaded rank by ``waiting * 4 + running``,
scanning from a start that rotates on every choice so ties spread. The counts are the ranks'
stats of the last step plus this rank's optimistic increments since (a burst of requests
between two steps does not all land on one rank). The BalanceScheduler rule: when any rank
is at its sequence cap, no rank admits new work that step (the ranks stay within one step of
each other's batch size, so no rank waits on a much bigger one in every collective).
Pure Python: the leader core runs it, the unit tests pin its exact choices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import assert_never

from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.engine.messages import (
    AbortRequests,
    AddRequest,
    MigrateRequests,
    Outputs,
    RankMessage,
    Rejected,
    Shutdown,
    ToCore,
)
from dsv4_serving.engine.request import EngineCoreOutput


class DPRouter:
    def __init__(self, size: int) -> None:
        self.size = size
        self.waiting = [0] * size
        self.running = [0] * size
        self._start = 0

    def update(self, stats: Sequence[SchedulerStats]) -> None:
        """The ranks' exact counts after a step replace the estimates."""
        self.waiting = [s.num_waiting for s in stats]
        self.running = [s.num_running for s in stats]

    def route(self, pinned: int | None = None) -> int:
        if pinned is not None:
            if not 0 <= pinned < self.size:
                raise ValueError(f"data parallel rank {pinned} is not in 0..{self.size - 1}")
            rank = pinned
        else:
            order = [(self._start + i) % self.size for i in range(self.size)]
            rank = min(order, key=lambda r: self.waiting[r] * 4 + self.running[r])
            self._start = (self._start + 1) % self.size
        self.waiting[rank] += 1
        return rank


def balance_freeze(stats: Sequence[SchedulerStats], max_num_seqs: int) -> bool:
    """True when some rank runs ``max_num_seqs`` requests: no rank admits new work."""
    return any(s.num_running >= max_num_seqs for s in stats)


def total_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """The instance's stats: counts summed, KV usage over all ranks' blocks."""
    if len(stats) == 1:
        return stats[0]
    out = SchedulerStats()
    for f in fields(SchedulerStats):
        if f.name not in ("kv_usage", "kv_transfer", "eplb", "host_spans"):
            setattr(out, f.name, sum(getattr(s, f.name) for s in stats))
    out.eplb = stats[0].eplb  # every EP rank has the same
    out.host_spans = [x for s in stats for x in s.host_spans]
    used = sum(s.kv_usage * s.num_total_blocks for s in stats)
    out.kv_usage = used / out.num_total_blocks if out.num_total_blocks else 0.0
    return out


@dataclass(frozen=True, slots=True)
class StepHeader:
    inboxes: list[list[RankMessage]]  # by DP rank
    freeze: bool  # no rank admits new work this step
    stop: bool = False


@dataclass(frozen=True, slots=True)
class RankReport:
    outputs: list[EngineCoreOutput]
    rejected: list[Rejected]
    stats: SchedulerStats
    busy: bool


class Leader:
    """The DP-rank-0 core's policy: routing, aborts to the owning rank, the freeze."""

    def __init__(self, size: int, max_num_seqs: int) -> None:
        self.router = DPRouter(size)
        self.max_num_seqs = max_num_seqs
        self.owner: dict[str, int] = {}
        self.freeze = False
        self.busy = False

    def header(self, msgs: list[ToCore]) -> tuple[StepHeader, list[Rejected]]:
        size = self.router.size
        inboxes: list[list[RankMessage]] = [[] for _ in range(size)]
        rejected: list[Rejected] = []
        stop = False
        for msg in msgs:
            match msg:
                case AddRequest(request=req):
                    try:
                        rank = self.router.route(req.data_parallel_rank)
                    except ValueError as exc:
                        rejected.append(Rejected(req.request_id, str(exc)))
                        continue
                    self.owner[req.request_id] = rank
                    inboxes[rank].append(msg)
                case AbortRequests(request_ids=ids):
                    for rank, rids in self._by_owner(ids).items():
                        inboxes[rank].append(AbortRequests(rids))
                case MigrateRequests(request_ids=ids):
                    for rank, rids in self._by_owner(ids).items():
                        inboxes[rank].append(MigrateRequests(tuple(rids)))
                case Shutdown():
                    stop = True
                case _:
                    assert_never(msg)
        return StepHeader(inboxes, self.freeze, stop), rejected

    def _by_owner(self, ids: Iterable[str]) -> dict[int, list[str]]:
        by_rank: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self.owner:
                by_rank.setdefault(self.owner[rid], []).append(rid)
        return by_rank

    def collect(self, reports: list[RankReport]) -> Outputs:
        stats = [r.stats for r in reports]
        self.router.update(stats)
        self.freeze = balance_freeze(stats, self.max_num_seqs)
        self.busy = any(r.busy for r in reports)
        outputs = [o for r in reports for o in r.outputs]
        for o in outputs:
            if o.finish_reason is not None or o.error is not None:
                self.owner.pop(o.request_id, None)
        return Outputs(outputs, total_stats(stats), tuple(stats))
