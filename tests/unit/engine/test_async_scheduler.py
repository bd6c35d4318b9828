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


def make(num_blocks=64, budget=16, seqs=8, caching=False, state=False, k=0):  # type: ignore[no-untyped-def]
    kv = KVCacheManager(num_blocks, BS, seqs, enable_caching=caching, has_state=state)
    return AsyncScheduler(SchedulerConfig(seqs, budget, 256, True, k), kv), kv


def add(sched: AsyncScheduler, rid: str, prompt: list[int], n: int, stop: int | None = None):  # type: ignore[no-untyped-def]
    sp = SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True, stop_token_ids=[stop] if stop else []
    )
    sched.add_request(Request(EngineCoreRequest(rid, prompt, sp), eos_token_id=None))


def drive(sched: AsyncScheduler, runner: FakeRunner, max_steps: int = 2000) -> dict[str, list[int]]:
    """The core's async loop: schedule and submit N+1, then take N's outputs."""
    steps = StepThread(lambda out, chain, prepared, started: runner.execute(out))
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
    prev = SchedulerOutput(
        [ScheduledRequest("a", [4], 4, 0, [0, 1], 0, True, None, sp, 0)], [], [], 1
    )
    out = SchedulerOutput(
        [
            ScheduledRequest("a", [PLACEHOLDER], 5, 0, [0, 1], 0, True, None, sp, 0),
            ScheduledRequest("b", [3, 4, 5], 0, 0, [2], 1, True, None, sp, 0),
        ],
        [],
        [],
        4,
    )
    fill_placeholders(out, prev, {"a": RunnerResult([77]), "c": RunnerResult([5])})
    assert [s.token_ids for s in out.scheduled] == [[77], [3, 4, 5]]
    assert [s.num_output_tokens for s in out.scheduled] == [1, 0]


def test_fill_placeholders_moves_back_by_the_rejected_drafts() -> None:
    """Step N verified 2 drafts at position 10 and accepted 1: N+1, scheduled at 10 + 3,
    runs at 12 with N's sampled token and N's new drafts."""
    sp = SamplingParams()
    prev = SchedulerOutput(
        [ScheduledRequest("a", [7, 8, 9], 10, 2, [0], 0, True, None, sp, 4)], [], [], 3
    )
    out = SchedulerOutput(
        [ScheduledRequest("a", [PLACEHOLDER] * 3, 13, 2, [0], 0, True, None, sp, 4)], [], [], 3
    )
    fill_placeholders(out, prev, {"a": RunnerResult([8, 30], None, [31, 32])})
    (s,) = out.scheduled
    assert (s.token_ids, s.context_len, s.num_spec, s.num_output_tokens) == ([30, 31, 32], 12, 2, 6)


def test_mtp_placeholders_step_by_step() -> None:
    """k = 2: a step that verifies 2 drafts leaves 3 placeholders; the next one is scheduled
    at the position all of them accepted reach and moved back when the count is known."""
    sched, kv = make(k=2)
    add(sched, "a", [1, 2, 3, 4, 5], 20)
    req = sched.requests["a"]
    s1 = sched.schedule()  # the prompt: samples, no drafts yet
    assert shape(s1) == [("a", [1, 2, 3, 4, 5], 0, True)]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (5, 1)
    assert req.spec_token_ids == [PLACEHOLDER] * 2
    s2 = sched.schedule()  # its token and 2 drafts: all from step 1
    assert shape(s2) == [("a", [PLACEHOLDER] * 3, 5, True)] and s2.scheduled[0].num_spec == 2
    assert (req.num_computed_tokens, req.num_output_placeholders) == (8, 4)
    sched.update_from_output(s1, {"a": RunnerResult([40], None, [41, 42])})
    assert (req.num_computed_tokens, req.num_output_placeholders) == (8, 3)
    s3 = sched.schedule()  # at 8 + 3, as if step 2 accepted both drafts
    assert shape(s3) == [("a", [PLACEHOLDER] * 3, 8, True)]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (11, 6)
    # step 2 ran at 5 with [40, 41, 42]: 41 accepted, then 50 (42 rejected)
    (o,) = sched.update_from_output(s2, {"a": RunnerResult([41, 50], None, [51, 52])})
    assert o.new_token_ids == [41, 50]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (10, 3)
    assert req.all_token_ids[5:] == [40, 41, 50]
    # step 3 (moved to 7 by the step thread) accepts both: nothing left in flight, the next
    # schedule verifies its drafts itself at the real position
    (o,) = sched.update_from_output(s3, {"a": RunnerResult([51, 52, 60], None, [61, 62])})
    assert (req.num_computed_tokens, req.num_output_placeholders) == (10, 0)
    assert req.num_tokens == 11 and req.spec_token_ids == [61, 62]
    s4 = sched.schedule()
    assert shape(s4) == [("a", [60, 61, 62], 10, True)]
    assert sched.stats.spec_draft_tokens == 4 and sched.stats.spec_accepted_tokens == 3
    assert kv.num_free_blocks < 64


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


@pytest.mark.parametrize(("k", "num_blocks", "budget"), [(1, 200, 16), (2, 200, 7), (3, 14, 16)])
def test_async_mtp_runs_equal_runs_alone(k: int, num_blocks: int, budget: int) -> None:
    """The fake model's first draft is right and the others wrong: accepted and rejected
    drafts, chunked prompts and preemption (14 blocks) through the real step thread."""
    ps = prompts(10)
    sched, kv = make(num_blocks=num_blocks, budget=budget, seqs=5, k=k)
    for i, p in enumerate(ps):
        add(sched, f"r{i}", p, 4 + i % 7)
    runner = FakeRunner(k)
    got = drive(sched, runner)
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == alone(p, 4 + i % 7), (k, i)
    assert kv.num_free_blocks == num_blocks and kv.num_free_slots == 5
    assert sched.stats.spec_accepted_tokens > 0
    if k > 1:
        assert sched.stats.spec_accepted_tokens < sched.stats.spec_draft_tokens
    if num_blocks == 14:
        assert sched.stats.num_preemptions > 0


def test_async_scheduling_is_refused_where_it_is_not_exact() -> None:
    assert EngineConfig(num_speculative_tokens=0).async_unsupported() is None
    assert EngineConfig(num_speculative_tokens=2).async_unsupported() is None
    assert EngineConfig(tensor_parallel_size=2).async_unsupported() is None
    assert EngineConfig(data_parallel_size=2).async_unsupported() is None
    cp = EngineConfig(context_parallel_size=2, num_speculative_tokens=0)
    assert cp.async_unsupported() is None  # CP composes with async
    cp_mtp = EngineConfig(context_parallel_size=2, num_speculative_tokens=1)
    assert "context parallelism with MTP" in (cp_mtp.async_unsupported() or "")
    cp_default = EngineConfig(context_parallel_size=2)  # -1: the model decides, MTP 1 here
    assert "context parallelism with MTP" in (cp_default.async_unsupported() or "")
    assert EngineConfig(async_scheduling="on", num_speculative_tokens=1).async_scheduling == "on"
    with pytest.raises(ConfigError, match="--async-scheduling on: context parallelism"):
        EngineConfig(
            async_scheduling="on",
            context_parallel_size=2,
            data_parallel_size=2,
            num_speculative_tokens=0,
        )
    with pytest.raises(ConfigError, match="auto, on or off"):
        EngineConfig(async_scheduling="yes")  # type: ignore[arg-type]
