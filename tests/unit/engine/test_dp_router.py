"""DP routing: the header pins, else the least-loaded rank by waiting * 4 + running with ties
rotating and optimistic counts; the BalanceScheduler freeze; the instance's summed stats; the
leader core's step header (inboxes per rank, aborts to the owner) and what it hands on."""

from __future__ import annotations

import pytest

from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.dp.router import (
    DPRouter,
    Leader,
    RankReport,
    balance_freeze,
    total_stats,
)
from dsv4_serving.engine.engine.messages import AbortRequests, AddRequest, Rejected, Shutdown
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams


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


def _add(rid: str, pin: int | None = None) -> AddRequest:
    req = EngineCoreRequest(rid, [1, 2], SamplingParams(), 0.0, data_parallel_rank=pin)
    return AddRequest(req)


def test_the_leader_routes_adds_and_sends_each_abort_to_the_rank_holding_it() -> None:
    lead = Leader(size=2, max_num_seqs=4)
    header, rejected = lead.header([_add("a"), _add("b"), _add("c", pin=1), _add("d", pin=5)])
    assert header.inboxes == [[_add("a")], [_add("b"), _add("c", pin=1)]]
    assert rejected == [Rejected("d", "data parallel rank 5 is not in 0..1")]
    assert (header.freeze, header.stop) == (False, False)
    header, _ = lead.header([AbortRequests(["c", "a", "gone"]), Shutdown()])
    assert header.inboxes == [[AbortRequests(["a"])], [AbortRequests(["c"])]]
    assert header.stop


def test_the_leader_freezes_admission_after_a_rank_reached_its_cap_and_forgets_finished() -> None:
    lead = Leader(size=2, max_num_seqs=2)
    lead.header([_add("a"), _add("b")])
    done = EngineCoreOutput("a", [7], finish_reason="length")
    going = EngineCoreOutput("b", [8])
    reports = [
        RankReport([done], [], _stats(0, 2), busy=True),
        RankReport([going], [], _stats(3, 1), busy=True),
    ]
    out = lead.collect(reports)
    assert out.outputs == [done, going]
    assert out.rank_stats == (_stats(0, 2), _stats(3, 1))
    assert (out.stats.num_waiting, out.stats.num_running) == (3, 3)
    assert lead.busy and lead.owner == {"b": 1}
    assert lead.header([])[0].freeze  # rank 0 runs 2 = max_num_seqs
    assert lead.router.route() == 0  # rank 0 scores 2, rank 1 scores 13
