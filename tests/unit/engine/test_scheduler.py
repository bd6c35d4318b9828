"""The scheduler and KV cache manager with a fake model (a pure function of the token
history), so every schedule must produce the same tokens as running each request alone."""

from __future__ import annotations

from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, Scheduler, SchedulerConfig
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams

BS = 4


def nxt(hist: list[int]) -> int:
    return (31 * hist[-1] + 7 * len(hist)) % 97


class FakeRunner:
    """Checks the step is consistent with what it saw before, then 'samples' nxt(history);
    drafts: the first is right, the rest wrong (so 1 of k is accepted when k > 1)."""

    def __init__(self, k: int = 0) -> None:
        self.k = k
        self.hist: dict[str, list[int]] = {}
        self.steps: list[list[tuple[str, int]]] = []

    def execute(self, out) -> dict[str, RunnerResult]:  # type: ignore[no-untyped-def]
        res = {}
        self.steps.append([(s.request_id, len(s.token_ids)) for s in out.scheduled])
        for s in out.scheduled:
            h = self.hist.get(s.request_id, [])
            assert len(h) >= s.context_len, "context beyond what was computed"
            known = s.token_ids[: len(s.token_ids) - s.num_spec]
            h = h[: s.context_len] + known
            self.hist[s.request_id] = h
            assert len(s.block_ids) * BS >= s.context_len + len(s.token_ids)
            if not s.sample:
                continue
            toks = []
            for d in s.token_ids[len(known) :]:
                t = nxt(h + toks)
                toks.append(t)
                if t != d:
                    break
            else:
                toks.append(nxt(h + toks))
            self.hist[s.request_id] = h + toks[:-1]
            full = h + toks
            drafts = [nxt(full)] + [0] * (self.k - 1) if self.k else []
            res[s.request_id] = RunnerResult(toks, None, drafts)
        return res


def alone(prompt: list[int], n: int) -> list[int]:
    h = list(prompt)
    for _ in range(n):
        h.append(nxt(h))
    return h[len(prompt) :]


def make(num_blocks=64, budget=16, seqs=8, k=0, chunked=True, caching=False):  # type: ignore[no-untyped-def]
    kv = KVCacheManager(num_blocks, BS, seqs, enable_caching=caching)
    cfg = SchedulerConfig(seqs, budget, 256, chunked, k)
    return Scheduler(cfg, kv), kv


def add(sched: Scheduler, rid: str, prompt: list[int], n: int) -> None:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    sched.add_request(Request(EngineCoreRequest(rid, prompt, sp), eos_token_id=None))


def drive(sched: Scheduler, runner: FakeRunner, max_steps: int = 500) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return got
        out = sched.schedule()
        for o in sched.update_from_output(out, runner.execute(out)):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")


def prompts(n: int) -> list[list[int]]:
    return [[(i * 13 + j) % 97 for j in range(3 + (i * 7) % 19)] for i in range(n)]


def test_budget_splits_prefill_into_chunks_mixed_with_decodes() -> None:
    sched, _kv = make(budget=10)
    add(sched, "a", list(range(8)), 3)
    add(sched, "b", list(range(20, 32)), 3)
    runner = FakeRunner()
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [
        ("a", 8, True),
        ("b", 2, False),
    ]
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()  # a decodes 1 token, b continues with the remaining budget
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 9)]


def test_no_chunking_waits_for_a_whole_prompt() -> None:
    sched, _ = make(budget=10, chunked=False)
    add(sched, "a", list(range(8)), 2)
    add(sched, "b", list(range(12)), 2)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a"]


def test_max_num_seqs_and_fcfs() -> None:
    sched, _ = make(seqs=2, budget=100)
    for i in range(4):
        add(sched, f"r{i}", [i + 1] * 3, 2)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]


def test_batched_chunked_preempted_runs_equal_runs_alone_and_free_all_blocks() -> None:
    ps = prompts(12)
    for num_blocks, budget in ((200, 16), (200, 5), (12, 16)):
        sched, kv = make(num_blocks=num_blocks, budget=budget, seqs=6)
        for i, p in enumerate(ps):
            add(sched, f"r{i}", p, 4 + i % 5)
        got = drive(sched, FakeRunner())
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == alone(p, 4 + i % 5), (num_blocks, budget, i)
        assert kv.num_free_blocks == num_blocks and kv.num_free_slots == 6
        if num_blocks == 12:
            assert sched.stats.num_preemptions > 0


def test_preemption_takes_the_latest_arrival_and_requeues_it_first() -> None:
    sched, kv = make(num_blocks=4, budget=64, seqs=4)
    add(sched, "old", [1] * 8, 8)  # 2 full blocks; its first decode needs a 3rd
    add(sched, "new", [2] * 8, 8)
    runner = FakeRunner()
    out = sched.schedule()
    assert kv.num_free_blocks == 0
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()  # "old" needs a 3rd block: "new" is preempted
    assert [s.request_id for s in out.scheduled] == ["old"]
    assert [r.request_id for r in sched.waiting] == ["new"]
    assert sched.requests["new"].num_computed_tokens == 0


def test_abort_frees_blocks_of_waiting_and_running_requests() -> None:
    sched, kv = make(num_blocks=20, budget=8)
    add(sched, "a", list(range(10)), 5)
    add(sched, "b", list(range(10)), 5)
    out = sched.schedule()
    sched.update_from_output(out, FakeRunner().execute(out))
    assert kv.num_free_blocks < 20
    assert sorted(sched.abort_requests(["a", "b", "zzz"])) == ["a", "b"]
    assert kv.num_free_blocks == 20 and not sched.has_unfinished_requests()
    assert sorted(sched.schedule().finished_ids) == ["a", "b"]


def test_speculative_tokens_are_verified_and_counted() -> None:
    ps = prompts(6)
    for k in (1, 3):
        sched, kv = make(num_blocks=100, budget=32, k=k)
        for i, p in enumerate(ps):
            add(sched, f"r{i}", p, 9)
        got = drive(sched, FakeRunner(k))
        assert all(got[f"r{i}"] == alone(p, 9) for i, p in enumerate(ps))
        st = sched.stats
        assert st.spec_accepted_tokens > 0 and st.spec_draft_tokens == k * st.spec_drafts
        if k == 3:  # the later drafts are (almost always) wrong
            assert st.spec_accepted_tokens < st.spec_draft_tokens
        assert kv.num_free_blocks == 100


def test_prefix_hit_shares_blocks_and_skips_their_prefill() -> None:
    sched, kv = make(num_blocks=32, budget=64, caching=True)
    shared = list(range(1, 13))  # 3 full blocks
    add(sched, "a", [*shared, 50], 2)
    drive(sched, FakeRunner())
    assert kv.num_free_blocks == 32
    add(sched, "b", [*shared, 60, 61], 2)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.context_len == 12 and s.token_ids == [60, 61]
    assert sched.stats.prefix_hits == 12
    # "a" freed its blocks last-first (its partial block 3, then 2, 1, 0); the hit took 0-2
    assert s.block_ids[:3] == [0, 1, 2]


def test_prefix_hit_on_a_stateful_model_needs_a_snapshot_at_the_boundary() -> None:
    kv = KVCacheManager(32, BS, 2, enable_caching=True, has_state=True, num_snapshot_slots=2)
    sched = Scheduler(SchedulerConfig(2, 6, 256, True, 0), kv)
    shared = list(range(1, 13))
    add(sched, "a", [*shared, 50], 1)
    runner = FakeRunner()
    out = sched.schedule()
    (s,) = out.scheduled
    # chunk 0-6: the model writes the state at boundary 4 into spare slot 2 during the forward
    assert (len(s.token_ids), s.snapshots) == (6, [(4, 2)])
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    assert out.scheduled[0].snapshots == [(8, 3)]  # chunk 6-12: boundary 8 inside it
    sched.update_from_output(out, runner.execute(out))
    # the chunk ended exactly on 12: its slot is copied into the LRU snapshot slot (2, was 4)
    out = sched.schedule()
    assert out.state_copies == [(0, 2)] and len(out.scheduled[0].token_ids) == 1
    sched.update_from_output(out, runner.execute(out))
    assert not sched.has_unfinished_requests()
    add(sched, "b", [*shared, 60], 1)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.context_len == 12
    assert out.state_copies[-1] == (2, s.state_slot)  # restore the snapshot at 12
    sched.abort_requests(["b"])
    add(sched, "c", [*shared[:8], 70], 1)
    assert sched.schedule().scheduled[0].context_len == 8  # the snapshot at 8 is in slot 3
    sched.abort_requests(["c"])
    add(sched, "d", [*shared[:4], 80], 1)
    assert sched.schedule().scheduled[0].context_len == 0  # the one at 4 was evicted
