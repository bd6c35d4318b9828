"""Async scheduling's pure parts: the placeholder accounting of ``AsyncScheduler`` step by
step, stops found one step late (the extra token dropped, every block and slot freed), and
batched / chunked / preempted / prefix-cached runs through the real step thread giving every
request the tokens it gets alone (the fake model of ``test_scheduler``)."""

from __future__ import annotations

import pytest

from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.async_scheduler import PLACEHOLDER, AsyncScheduler
from dsv4_serving.engine.core.sched.scheduler import (
    RunnerResult,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.worker.step_thread import StepThread, fill_placeholders

from .test_scheduler import BS, FakeRunner, alone, prompts


def make(num_blocks=64, budget=16, seqs=8, caching=False, state=False):  # type: ignore[no-untyped-def]
    kv = KVCacheManager(num_blocks, BS, seqs, enable_caching=caching, has_state=state)
    return AsyncScheduler(SchedulerConfig(seqs, budget, 256, True, 0), kv), kv


def add(sched: AsyncScheduler, rid: str, prompt: list[int], n: int, stop: int | None = None):  # type: ignore[no-untyped-def]
    sp = SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True, stop_token_ids=[stop] if stop else []
    )
    sched.add_request(Request(EngineCoreRequest(rid, prompt, sp), eos_token_id=None))


def drive(sched: AsyncScheduler, runner: FakeRunner, max_steps: int = 2000) -> dict[str, list[int]]:
    """The core's async loop: schedule and submit N+1, then take N's outputs."""
    steps = StepThread(runner.execute)
    got: dict[str, list[int]] = {}
    in_flight = None
    try:
        for _ in range(max_steps):
            if not sched.has_unfinished_requests() and in_flight is None:
                return got
            out = sched.schedule()
            nxt = (out, steps.submit(out)) if out.scheduled or out.finished_ids else None
            prev, in_flight = in_flight, nxt
            if prev is not None:
                for o in sched.update_from_output(prev[0], prev[1].result()):
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
    finally:
        steps.close()
    raise AssertionError("requests did not finish")


class SharedPrefixRunner(FakeRunner):
    """A request that starts on a prefix hit has the shared prefix as its history."""

    def __init__(self, prefix: list[int]) -> None:
        super().__init__()
        self.prefix = prefix

    def execute(self, out):  # type: ignore[no-untyped-def]
        for s in out.scheduled:
            if s.request_id not in self.hist and s.context_len:
                assert s.context_len <= len(self.prefix)
                self.hist[s.request_id] = self.prefix[: s.context_len]
        return super().execute(out)


def shape(out: SchedulerOutput) -> list[tuple[str, list[int], int, bool]]:
    return [(s.request_id, s.token_ids, s.context_len, s.sample) for s in out.scheduled]


def test_placeholders_step_by_step() -> None:
    sched, kv = make()
    add(sched, "a", [1, 2, 3, 4, 5], 3)
    req = sched.requests["a"]
    s1 = sched.schedule()
    assert shape(s1) == [("a", [1, 2, 3, 4, 5], 0, True)]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (5, 1)
    s2 = sched.schedule()  # step 1 still running: its token is a placeholder
    assert shape(s2) == [("a", [PLACEHOLDER], 5, True)]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (6, 2)
    (o,) = sched.update_from_output(s1, {"a": RunnerResult([40])})
    assert (o.new_token_ids, o.finish_reason) == ([40], None)
    assert req.all_token_ids == [1, 2, 3, 4, 5, 40] and req.num_output_placeholders == 1
    s3 = sched.schedule()
    assert shape(s3) == [("a", [PLACEHOLDER], 6, True)]
    sched.update_from_output(s2, {"a": RunnerResult([41])})
    # step 3 samples the last of max_tokens=3: nothing past it is scheduled
    assert sched.schedule().scheduled == []
    (o,) = sched.update_from_output(s3, {"a": RunnerResult([42])})
    assert (o.new_token_ids, o.finish_reason) == ([42], "length")
    assert req.all_token_ids[5:] == [40, 41, 42] and req.num_output_placeholders == 0
    assert kv.num_free_blocks == 64 and kv.num_free_slots == 8
    assert sched.schedule().finished_ids == ["a"]


def test_a_stop_found_one_step_late_drops_the_extra_token_and_frees_everything() -> None:
    sched, kv = make()
    add(sched, "a", [1, 2, 3], 10, stop=40)
    add(sched, "b", [7, 8], 3)
    s1 = sched.schedule()
    s2 = sched.schedule()  # both scheduled again before step 1's tokens are known
    assert [x.request_id for x in s2.scheduled] == ["a", "b"]
    outs = sched.update_from_output(s1, {"a": RunnerResult([40]), "b": RunnerResult([9])})
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [40], "stop"),
        ("b", [9], None),
    ]
    assert "a" not in sched.requests and kv.block_ids("a") == []
    s3 = sched.schedule()
    assert s3.finished_ids == ["a"] and [x.request_id for x in s3.scheduled] == ["b"]
    outs = sched.update_from_output(s2, {"a": RunnerResult([41]), "b": RunnerResult([10])})
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("b", [10])]  # a's 41: dropped
    assert sched.schedule().scheduled == []  # b's last token is in flight
    sched.update_from_output(s3, {"b": RunnerResult([11])})
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == 64 and kv.num_free_slots == 8


def test_fill_placeholders_takes_the_previous_steps_tokens() -> None:
    sp = SamplingParams()
    out = SchedulerOutput(
        [
            ScheduledRequest("a", [PLACEHOLDER], 5, 0, [0, 1], 0, True, None, sp, 1),
            ScheduledRequest("b", [3, 4, 5], 0, 0, [2], 1, True, None, sp, 0),
        ],
        [],
        [],
        4,
    )
    fill_placeholders(out, {"a": 77, "c": 5})
    assert [s.token_ids for s in out.scheduled] == [[77], [3, 4, 5]]


@pytest.mark.parametrize(
    ("num_blocks", "budget", "caching"),
    [(200, 16, False), (200, 5, False), (12, 16, False), (60, 7, True)],
)
def test_async_runs_equal_runs_alone_and_free_all_blocks(
    num_blocks: int, budget: int, caching: bool
) -> None:
    ps = prompts(12)
    prefix = list(range(1, 13))  # 3 blocks
    if caching:
        ps = [[*prefix, *p] for p in ps]
    sched, kv = make(num_blocks=num_blocks, budget=budget, seqs=6, caching=caching)
    for i, p in enumerate(ps):
        add(sched, f"r{i}", p, 4 + i % 5)
    got = drive(sched, SharedPrefixRunner(prefix))
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == alone(p, 4 + i % 5), (num_blocks, budget, i)
    assert kv.num_free_blocks == num_blocks and kv.num_free_slots == 6
    if num_blocks == 12:
        assert sched.stats.num_preemptions > 0
    if caching:
        assert sched.stats.prefix_hits > 0


def test_stops_one_step_late_in_a_batch_equal_the_truncated_runs_alone() -> None:
    ps = prompts(10)
    want = {f"r{i}": alone(p, 12) for i, p in enumerate(ps)}
    sched, kv = make(num_blocks=40, budget=9, seqs=5)
    for i, p in enumerate(ps):
        stop = want[f"r{i}"][2 + i % 7]
        add(sched, f"r{i}", p, 12, stop=stop)
        w = want[f"r{i}"]
        want[f"r{i}"] = w[: w.index(stop) + 1]
    assert drive(sched, FakeRunner()) == want
    assert kv.num_free_blocks == 40 and kv.num_free_slots == 5


def test_async_scheduling_is_refused_where_it_is_not_exact() -> None:
    assert EngineConfig(num_speculative_tokens=0).async_unsupported() is None
    assert "MTP" in (EngineConfig().async_unsupported(2) or "")
    assert EngineConfig(tensor_parallel_size=2).async_unsupported(0) is None
    assert "DP" in (EngineConfig(data_parallel_size=2).async_unsupported(0) or "")
    assert EngineConfig(context_parallel_size=2).async_unsupported(0) is None  # CP composes
    with pytest.raises(ConfigError, match="MTP"):
        EngineConfig(async_scheduling="on", num_speculative_tokens=1)
    with pytest.raises(ConfigError, match="DP"):
        EngineConfig(async_scheduling="on", num_speculative_tokens=0, data_parallel_size=2)
    with pytest.raises(ConfigError, match="auto, on or off"):
        EngineConfig(async_scheduling="yes")  # type: ignore[arg-type]
