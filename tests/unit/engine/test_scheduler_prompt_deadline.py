"""The scheduler with a prompt deadline: the waiting prompts that can still make it are
admitted first, the late ones after them, and every request still gets the tokens it gets
alone with every block freed."""

from __future__ import annotations

import random

from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.prefill_order import StepCost
from dsv4_serving.engine.core.sched.scheduler import Scheduler, SchedulerConfig
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams

from .test_scheduler import BS, FakeRunner, alone, prompts


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Known:
    """A step cost known from the start (the engine fits one to its steps)."""

    def __init__(self, token_s: float) -> None:
        self.cost = StepCost(0.0, token_s)

    def observe(self, seconds: float, num_tokens: int) -> None:
        pass


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
    assert Scheduler(SchedulerConfig(4, 16, 256), kv).step_cost is None
    sched, _, clock = make(deadline=1.0, budget=4)
    add(sched, "late", [1] * 4, 1, arrival=clock.t - 5)
    add(sched, "fresh", [2] * 4, 1, arrival=clock.t)
    assert sched.step_cost is not None and sched.step_cost.cost is None
    assert [s.request_id for s in sched.schedule().scheduled] == ["late"]


def test_a_prompt_past_its_deadline_goes_behind_the_ones_that_can_make_it() -> None:
    sched, _, clock = make(deadline=1.0, budget=4)
    sched.step_cost = Known(0.05)  # type: ignore[assignment]
    add(sched, "late", [1] * 4, 1, arrival=clock.t - 5)
    add(sched, "a", [2] * 4, 1, arrival=clock.t - 0.1)
    add(sched, "b", [3] * 4, 1, arrival=clock.t)
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 4)]
    assert ids(sched.waiting) == ["b", "late"]
    assert sched.stats.num_late_prompts == 1


def test_a_late_running_prompt_waits_behind_a_fresh_one_and_keeps_its_blocks() -> None:
    sched, _, clock = make(deadline=1.0, budget=4)
    sched.step_cost = Known(0.05)  # type: ignore[assignment]
    add(sched, "big", [9] * 16, 1, arrival=clock.t - 5)
    runner = FakeRunner()
    out = sched.schedule()
    blocks = out.scheduled[0].block_ids
    sched.update_from_output(out, runner.execute(out))
    add(sched, "fresh", [1] * 3, 1, arrival=clock.t)
    out = sched.schedule()
    # not even the budget left: a late prompt only gets steps no on-time prompt is in
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("fresh", 3)]
    assert sched.kv.block_ids("big") == blocks and sched.requests["big"].num_computed_tokens == 4
    assert sched.stats.num_late_prompts == 1
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("big", 4)]


def test_requests_past_their_first_token_keep_their_place_in_front() -> None:
    sched, _, clock = make(deadline=1.0, num_blocks=4, budget=64, seqs=4)
    sched.step_cost = Known(0.01)  # type: ignore[assignment]
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
        sched.step_cost = Known(0.01)  # type: ignore[assignment]
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
