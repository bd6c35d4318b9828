"""The SLO-aware prompt order: exact orders for small tables, and the rule's promise (the
most prompts on time) checked against every order of small random sets."""

from __future__ import annotations

import itertools
import random

import pytest

from dsv4_serving.engine.core.sched.prefill_order import (
    Prompt,
    StepCost,
    StepCostModel,
    prefill_order,
)

P = Prompt
# (id, prompts in arrival order as (deadline, tokens), now, busy tokens, order, on time);
# one token takes 0.1 s throughout, steps have no base cost unless said
TOKEN = StepCost(0.0, 0.1)
CASES = [
    ("empty", [], 0.0, 0.0, [], 0),
    ("all fit: arrival order", [(1.0, 2), (1.1, 3), (1.2, 1)], 0.0, 0.0, [0, 1, 2], 3),
    # the same deadline for all (one TTFT objective): the longest is set aside
    ("overload drops the longest", [(0.5, 2), (0.5, 4), (0.5, 2)], 0.0, 0.0, [0, 2, 1], 2),
    # equal lengths: the one with the least slack (earliest deadline) goes behind
    (
        "equal lengths: the oldest goes late",
        [(0.3, 2), (0.5, 2), (0.55, 2)],
        0.0,
        0.0,
        [1, 2, 0],
        2,
    ),
    ("past due: late, in arrival order", [(-1.0, 1), (-0.5, 1), (1.0, 2)], 0.0, 0.0, [2, 0, 1], 1),
    # earlier deadlines first among the on-time ones, whatever the arrival order
    ("earliest deadline first", [(2.0, 1), (0.5, 1), (1.0, 1)], 0.0, 0.0, [1, 2, 0], 3),
    # work already running counts before every waiting prompt
    ("busy engine", [(0.5, 2), (0.9, 2)], 0.0, 4, [1, 0], 1),
    ("the clock moves on", [(10.5, 2), (10.9, 2)], 10.0, 0.0, [0, 1], 2),
    (
        "everything late keeps arrival order",
        [(0.1, 5), (0.2, 5), (0.15, 5)],
        0.0,
        0.0,
        [0, 1, 2],
        0,
    ),
]


@pytest.mark.parametrize(
    ("name", "table", "now", "busy", "order", "on_time"), CASES, ids=[c[0] for c in CASES]
)
def test_prefill_order_table(
    name: str,
    table: list[tuple[float, int]],
    now: float,
    busy: float,
    order: list[int],
    on_time: int,
) -> None:
    got = prefill_order([P(d, t) for d, t in table], now, TOKEN, busy)
    assert got == (order, on_time)


def test_a_prompt_is_done_at_the_end_of_its_last_step() -> None:
    # steps of at most 4 tokens, 0.2 s each plus 0.1 s a token
    cost = StepCost(0.2, 0.1)
    assert cost.seconds(2, 4) == pytest.approx(0.4)
    assert cost.seconds(6, 4) == pytest.approx(1.0)  # two steps
    assert prefill_order([P(0.35, 2), P(0.7, 2)], 0.0, cost, 0, 4) == ([1, 0], 1)
    assert prefill_order([P(0.45, 2), P(0.7, 2)], 0.0, cost, 0, 4) == ([0, 1], 2)
    # 3 tokens of this step are taken: the second prompt ends in the next step
    assert prefill_order([P(0.65, 1), P(0.9, 2)], 0.0, cost, 3, 4) == ([0, 1], 1)


def _on_time(prompts: list[Prompt], order: list[int], spt: float) -> int:
    t, n = 0.0, 0
    for i in order:
        t += prompts[i].tokens * spt
        n += t <= prompts[i].deadline + 1e-9
    return n


def test_no_order_has_more_prompts_on_time() -> None:
    rng = random.Random(7)
    for _ in range(300):
        prompts = [P(rng.randint(1, 12) / 4, rng.randint(1, 6)) for _ in range(rng.randint(1, 6))]
        order, on_time = prefill_order(prompts, 0.0, StepCost(0.0, 0.25))
        assert sorted(order) == list(range(len(prompts)))
        # the ones it calls on time are: served in its order, each finishes by its deadline
        assert _on_time(prompts, order[:on_time], 0.25) == on_time
        best = max(
            _on_time(prompts, list(p), 0.25) for p in itertools.permutations(range(len(prompts)))
        )
        assert on_time == best


def test_the_step_cost_is_fitted_to_the_steps() -> None:
    m = StepCostModel()
    assert m.cost is None
    m.observe(0.5, 2000)
    assert m.cost is None  # one step says nothing
    m.observe(0.5, 2000)
    assert m.cost is not None  # one size of step: a cost per token, no base
    assert (m.cost.base_s, m.cost.token_s) == (0.0, pytest.approx(0.5 / 2000))
    m = StepCostModel()
    for tokens in (1200, 2048, 300, 848, 1200):  # the emulated 20 ms + 0.2 ms a token
        m.observe(0.02 + 0.0002 * tokens, tokens)
    assert m.cost is not None
    assert (m.cost.base_s, m.cost.token_s) == (pytest.approx(0.02), pytest.approx(0.0002))
    m.observe(0.0, 100)  # ignored
    m.observe(0.1, 0)
    assert m.cost.base_s == pytest.approx(0.02)
