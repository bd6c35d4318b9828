"""SLO-aware prompt order (``--prompt-deadline``): which waiting prompts to prefill first so
that as many as possible have their first token by their deadline. Pure.

First come, first served is the best order while the engine keeps up. Under overload it is the
worst: every prompt waits behind the whole backlog, so once the backlog is longer than the TTFT
objective almost every prompt misses it, until the backlog has drained. Here the prompts that
can still make their deadline go first, earliest deadline first, and those that cannot go after
them in arrival order: they are still served (the scheduler gives them the steps no on-time
prompt is in), never dropped, so a late prompt is later than under FCFS, but about
capacity / arrival of the prompts keep the objective instead of almost none.

Which prompts can make it is Moore and Hodgson's rule (1968), the order that minimises the
number of late jobs on one machine: take the prompts by deadline, and whenever the one just
added would finish past its deadline, set aside the one needing the most time so far (the
one with the least slack among equals, so the prompts kept have room to spare). Time is the
engine's own: a base per step plus a cost per token, fitted to its steps (``StepCostModel``),
in steps of at most the token budget (a prompt's first token comes at the end of the step that
computes its last prompt token).
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


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds of a step: ``base_s`` plus ``token_s`` per batched token."""

    base_s: float
    token_s: float

    def seconds(self, tokens: int, step_tokens: int) -> float:
        """The first ``tokens`` tokens of work, in steps of at most ``step_tokens``: a prompt
        is done at the end of the step its last token is in."""
        return -(-tokens // step_tokens) * self.base_s + tokens * self.token_s


def prefill_order(
    prompts: Sequence[Prompt],
    now: float,
    cost: StepCost,
    busy_tokens: int = 0,
    step_tokens: int = 1 << 30,
) -> tuple[list[int], int]:
    """Indices of ``prompts`` (given in arrival order) in the order to prefill them, and how
    many of the first of those are on time: the on-time ones by deadline (then arrival), the
    late ones after them in arrival order. ``busy_tokens``: work already ahead of every prompt
    (this step's tokens so far); steps carry at most ``step_tokens`` (the token budget)."""
    by_deadline = sorted(range(len(prompts)), key=lambda i: (prompts[i].deadline, i))
    kept: list[tuple[int, float, int]] = []  # max-heap on tokens: (-tokens, deadline, index)
    late: set[int] = set()
    tokens = busy_tokens
    for i in by_deadline:
        p = prompts[i]
        heapq.heappush(kept, (-p.tokens, p.deadline, i))
        tokens += p.tokens
        # one removal suffices once anything is kept (the rule's invariant); the loop also
        # covers a prompt already past its deadline when nothing is ahead of it
        while kept and now + cost.seconds(tokens, step_tokens) > p.deadline:
            neg, _, j = heapq.heappop(kept)
            tokens += neg
            late.add(j)
    on_time = [i for i in by_deadline if i not in late]
    return on_time + sorted(late), len(on_time)


@dataclass(slots=True)
class StepCostModel:
    """This engine's ``StepCost``, fitted to its steps (wall clock, scheduling and all) by
    least squares with exponential forgetting (each step weighs ``1 - decay`` of the fit).
    None until steps of different sizes were seen; steps of one size only give a cost per
    token with no base. Until then the order stays first come, first served."""

    decay: float = 0.98
    _steps: int = 0
    _n: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, seconds: float, num_tokens: int) -> None:
        if num_tokens <= 0 or not seconds > 0:
            return
        d, x = self.decay, float(num_tokens)
        self._steps += 1
        self._n = d * self._n + 1
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds

    @property
    def cost(self) -> StepCost | None:
        if self._steps < 2:
            return None
        var = self._n * self._xx - self._x * self._x
        if var > 1e-6 * self._n * self._xx:
            token_s = (self._n * self._xy - self._x * self._y) / var
            base_s = (self._y - token_s * self._x) / self._n
            if token_s > 0 and base_s >= 0:
                return StepCost(base_s, token_s)
        return StepCost(0.0, self._y / self._x)  # one size of step, or a fit out of range
