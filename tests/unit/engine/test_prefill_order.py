"""The SLO-aware prompt order: exact orders for small tables, and the rule's promise (the
most prompts on time) checked against every order of small random sets."""

from __future__ import annotations

import itertools
import random

import pytest

from dsv4_serving.engine.prefill_order import PrefillRate, Prompt, prefill_order

P = Prompt
# (id, prompts in arrival order as (deadline, tokens), now, busy_s, order, on time);
# one token takes 0.1 s throughout
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
    ("busy engine", [(0.5, 2), (0.9, 2)], 0.0, 0.4, [1, 0], 1),
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
    got = prefill_order([P(d, t) for d, t in table], now, 0.1, busy)
    assert got == (order, on_time)


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
        order, on_time = prefill_order(prompts, 0.0, 0.25)
        assert sorted(order) == list(range(len(prompts)))
        # the ones it calls on time are: served in its order, each finishes by its deadline
        assert _on_time(prompts, order[:on_time], 0.25) == on_time
        best = max(
            _on_time(prompts, list(p), 0.25) for p in itertools.permutations(range(len(prompts)))
        )
        assert on_time == best


def test_rate_learns_from_full_steps_only() -> None:
    r = PrefillRate(min_tokens=100)
    r.observe(0.05, 10)  # a decode step: its fixed cost would read as a slow prefill
    assert r.seconds_per_token is None
    r.observe(0.2, 1000)
    assert r.seconds_per_token == pytest.approx(2e-4)
    r.observe(0.4, 1000)  # an exponential average, weight 0.2
    assert r.seconds_per_token == pytest.approx(2e-4 + 0.2 * 2e-4)
    r.observe(0.0, 1000)
    assert r.seconds_per_token == pytest.approx(2.4e-4)
