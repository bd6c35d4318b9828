"""The scheduler with a prompt deadline: the waiting prompts that can still make it are
admitted first, the late ones after them, and every request still gets the tokens it gets
alone with every block freed."""

from __future__ import annotations

import random

from dsv4_serving.engine.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sampling_params import SamplingParams
from dsv4_serving.engine.scheduler import Scheduler, SchedulerConfig

from .test_scheduler import BS, FakeRunner, alone, prompts


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(
    deadline: float, num_blocks: int = 200, budget: int = 16, seqs: int = 8
) -> tuple[Scheduler, KVCacheManager, Clock]:
    kv = KVCacheManager(num_blocks, BS, seqs)
    clock = Clock()
    cfg = SchedulerConfig(seqs, budget, 256, prompt_deadline=deadline)
    return Scheduler(cfg, kv, clock=clock), kv, clock


def add(sched: Scheduler, rid: str, prompt: list[int], n: int, arrival: float) -> None:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    req = EngineCoreRequest(rid, prompt, sp, arrival_time=arrival)
    sched.add_request(Request(req, eos_token_id=None))


def ids(reqs: object) -> list[str]:
    return [r.request_id for r in reqs]  # type: ignore[attr-defined]


def test_off_by_default_and_fcfs_until_the_speed_is_known() -> None:
    kv = KVCacheManager(64, BS, 4)
    assert Scheduler(SchedulerConfig(4, 16, 256), kv).rate is None
    sched, _, clock = make(deadline=1.0, budget=4)
    add(sched, "late", [1] * 4, 1, arrival=clock.t - 5)
    add(sched, "fresh", [2] * 4, 1, arrival=clock.t)
    assert sched.rate is not None and sched.rate.seconds_per_token is None
    assert [s.request_id for s in sched.schedule().scheduled] == ["late"]


def test_a_prompt_past_its_deadline_goes_behind_the_ones_that_can_make_it() -> None:
    sched, _, clock = make(deadline=1.0, budget=4)
    sched.observe_step(0.4, 8)  # a full step: 0.05 s a token
    add(sched, "late", [1] * 4, 1, arrival=clock.t - 5)
    add(sched, "a", [2] * 4, 1, arrival=clock.t - 0.1)
    add(sched, "b", [3] * 4, 1, arrival=clock.t)
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 4)]
    assert ids(sched.waiting) == ["b", "late"]
    assert sched.stats.num_late_prompts == 1


def test_the_running_prompts_chunks_count_before_the_waiting_ones() -> None:
    # "big" is running with 12 of 16 tokens to go (0.6 s ahead): of two prompts due in
    # 0.8 s, only one can finish in time after it
    sched, _, clock = make(deadline=0.8, budget=4)
    sched.observe_step(0.2, 4)  # 0.05 s a token
    add(sched, "big", [9] * 16, 1, arrival=clock.t)
    out = sched.schedule()
    sched.update_from_output(out, FakeRunner().execute(out))
    add(sched, "x", [1] * 3, 1, arrival=clock.t)
    add(sched, "y", [2] * 2, 1, arrival=clock.t)
    out = sched.schedule()  # "big" takes the whole budget; the order is decided anyway
    assert [s.request_id for s in out.scheduled] == ["big"]
    assert ids(sched.waiting) == ["y", "x"]  # the longer one is set aside


def test_requests_past_their_first_token_keep_their_place_in_front() -> None:
    sched, _, clock = make(deadline=1.0, num_blocks=4, budget=64, seqs=4)
    sched.observe_step(0.4, 40)  # 0.01 s a token
    add(sched, "old", [1] * 8, 8, arrival=clock.t - 10)  # 2 full blocks; a 3rd to decode
    add(sched, "new", [2] * 8, 8, arrival=clock.t - 10)
    runner = FakeRunner()
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()  # "new" is preempted after its first token
    assert ids(sched.waiting) == ["new"]
    sched.update_from_output(out, runner.execute(out))
    add(sched, "fresh", [3] * 4, 2, arrival=clock.t)
    sched.schedule()
    assert ids(sched.waiting) == ["new", "fresh"]  # no prompt deadline left for "new"


def test_reordered_batches_give_the_tokens_alone_and_free_every_block() -> None:
    rng = random.Random(3)
    ps = prompts(16)
    for num_blocks, budget in ((200, 16), (200, 5), (12, 16)):
        sched, kv, clock = make(deadline=0.3, num_blocks=num_blocks, budget=budget, seqs=6)
        sched.observe_step(0.01 * budget, budget)  # 0.01 s a token
        runner = FakeRunner()
        got: dict[str, list[int]] = {}
        pending = list(enumerate(ps))
        for _ in range(2000):
            # arrivals faster than the 0.01 s a token drains them: some go late
            while pending and rng.random() < 0.5:
                i, p = pending.pop(0)
                add(sched, f"r{i}", p, 3 + i % 4, arrival=clock.t)
            if not pending and not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            clock.t += 0.01 * out.num_batched_tokens
            for o in sched.update_from_output(out, runner.execute(out)):
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        else:
            raise AssertionError("requests did not finish")
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == alone(p, 3 + i % 4), (num_blocks, budget, i)
        assert kv.num_free_blocks == num_blocks and kv.num_free_slots == 6
        assert sched.stats.num_late_prompts > 0
        assert not sched._late  # forgotten once finished
