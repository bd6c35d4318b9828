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

from collections.abc import Sequence
from dataclasses import fields

from dsv4_serving.engine.scheduler import SchedulerStats


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
        if f.name not in ("kv_usage", "kv_transfer"):
            setattr(out, f.name, sum(getattr(s, f.name) for s in stats))
    used = sum(s.kv_usage * s.num_total_blocks for s in stats)
    out.kv_usage = used / out.num_total_blocks if out.num_total_blocks else 0.0
    return out
