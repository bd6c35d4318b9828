"""DP routing: the header pins, else the least-loaded rank by waiting * 4 + running with ties
rotating and optimistic counts; the BalanceScheduler freeze; the instance's summed stats."""

from __future__ import annotations

import pytest

from dsv4_serving.engine.dp_router import DPRouter, balance_freeze, total_stats
from dsv4_serving.engine.scheduler import SchedulerStats


def _stats(waiting: int, running: int) -> SchedulerStats:
    return SchedulerStats(num_waiting=waiting, num_running=running)


def test_ties_rotate_and_each_choice_counts_as_waiting_until_the_next_stats() -> None:
    r = DPRouter(3)
    assert [r.route() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert r.waiting == [3, 2, 2]


def test_least_loaded_rank_by_waiting_times_four_plus_running() -> None:
    r = DPRouter(2)
    r.update([_stats(waiting=1, running=0), _stats(waiting=0, running=3)])  # scores 4 and 3
    assert r.route() == 1  # 3 < 4; rank 1 now waits 1: score 7
    assert r.route() == 0  # 4 < 7; rank 0 now scores 8
    assert r.route() == 1  # 7 < 8
    assert r.waiting == [2, 2]


def test_a_pinned_request_goes_to_its_rank_whatever_the_load() -> None:
    r = DPRouter(2)
    r.update([_stats(0, 0), _stats(9, 9)])
    assert r.route(pinned=1) == 1
    assert r.waiting == [0, 10]
    with pytest.raises(ValueError, match=r"data parallel rank 2 is not in 0\.\.1"):
        r.route(pinned=2)


def test_no_rank_admits_while_any_rank_is_at_its_sequence_cap() -> None:
    assert balance_freeze([_stats(5, 4), _stats(0, 1)], max_num_seqs=4)
    assert not balance_freeze([_stats(5, 3), _stats(0, 3)], max_num_seqs=4)


def test_instance_stats_sum_the_ranks_and_weigh_kv_usage_by_blocks() -> None:
    a = SchedulerStats(num_running=2, num_free_blocks=10, num_total_blocks=40, kv_usage=0.75)
    b = SchedulerStats(num_running=1, num_free_blocks=50, num_total_blocks=60, kv_usage=1 / 6)
    a.prefix_hits, b.prefix_hits = 32, 16
    t = total_stats([a, b])
    assert (t.num_running, t.num_free_blocks, t.num_total_blocks, t.prefix_hits) == (
        3,
        60,
        100,
        48,
    )
    assert t.kv_usage == pytest.approx(0.4)
    assert total_stats([a]) is a
