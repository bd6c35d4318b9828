"""SLO-aware prompt order (``--prompt-deadline``): which waiting prompts to prefill first so
that as many as possible have their first token by their deadline. Pure.

First come, first served is the best order while the engine keeps up. Under overload it is the
worst: every prompt waits behind the whole backlog, so once the backlog is longer than the TTFT
objective almost every prompt misses it, until the backlog has drained. Here the prompts that
can still make their deadline go first, earliest deadline first, and those that cannot go after
them in arrival order: they are still served (as soon as the on-time ones leave room), never
dropped, so a late prompt is later than under FCFS, but about capacity / arrival of the
prompts keep the objective instead of almost none.

Which prompts can make it is Moore and Hodgson's rule (1968), the order that minimises the
number of late jobs on one machine: take the prompts by deadline, and whenever the one just
added would finish past its deadline, set aside the one needing the most time so far (the
one with the least slack among equals, so the prompts kept have room to spare). Time is the
engine's own: seconds per prompt token, learned from its full steps (``PrefillRate``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prompt:
    deadline: float
    """When its first token is due (epoch seconds: arrival + the prompt deadline)."""
    tokens: int
    """Prompt tokens it still needs computed."""


def prefill_order(
    prompts: Sequence[Prompt], now: float, seconds_per_token: float, busy_s: float = 0.0
) -> tuple[list[int], int]:
    """Indices of ``prompts`` (given in arrival order) in the order to prefill them, and how
    many of the first of those are on time: the on-time ones by deadline (then arrival), the
    late ones after them in arrival order. ``busy_s``: work already ahead of every prompt (the
    running prompts' remaining chunks)."""
    by_deadline = sorted(range(len(prompts)), key=lambda i: (prompts[i].deadline, i))
    kept: list[tuple[int, float, int]] = []  # max-heap on tokens: (-tokens, deadline, index)
    late: set[int] = set()
    tokens = 0
    for i in by_deadline:
        p = prompts[i]
        heapq.heappush(kept, (-p.tokens, p.deadline, i))
        tokens += p.tokens
        # one removal suffices once anything is kept (the rule's invariant); the loop also
        # covers a prompt already past its deadline when nothing is ahead of it
        while kept and now + busy_s + tokens * seconds_per_token > p.deadline:
            neg, _, j = heapq.heappop(kept)
            tokens += neg
            late.add(j)
    on_time = [i for i in by_deadline if i not in late]
    return on_time + sorted(late), len(on_time)


@dataclass(slots=True)
class PrefillRate:
    """Seconds per batched token of this engine's steps (forward, scheduling and all), an
    exponential average over the steps with at least ``min_tokens`` tokens: below that a step's
    fixed cost says little about how fast a backlog of prompts drains. None until such a step
    ran (the order stays first come, first served until then)."""

    min_tokens: int
    weight: float = 0.2
    seconds_per_token: float | None = None

    def observe(self, seconds: float, num_tokens: int) -> None:
        if num_tokens < self.min_tokens or not seconds > 0:
            return
        x = seconds / num_tokens
        prev = self.seconds_per_token
        self.seconds_per_token = x if prev is None else prev + self.weight * (x - prev)
