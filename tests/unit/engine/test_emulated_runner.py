"""The emulated step-time engine mode's pure parts: the step-time model, the token chain, and
the runner's step (sleep, tokens, draft verification) over a stand-in for the real runner."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.engine.core.sched.scheduler import ScheduledRequest, SchedulerOutput
from dsv4_serving.engine.emulated.runner import EmulatedRunner, emulated_token
from dsv4_serving.engine.emulated.step_time import StepTime, StepTimeError
from dsv4_serving.engine.sample.sampling_params import SamplingParams


def test_step_time_parses_and_is_linear_in_sequences_and_tokens() -> None:
    st = StepTime.parse("5,0.5,0.25")
    assert st == StepTime(5.0, 0.5, 0.25)
    assert st.seconds(4, 100) == pytest.approx((5 + 2 + 25) / 1e3)
    assert st.seconds(0, 0) == 0.0  # an empty step costs nothing
    assert str(st) == "5,0.5,0.25"


@pytest.mark.parametrize("bad", ["5,1", "a,b,c", "5,-1,0", "5,1,inf", "5,1,nan", ""])
def test_step_time_rejects_bad_text_naming_the_flag(bad: str) -> None:
    with pytest.raises(StepTimeError, match="--emulate-step-time"):
        StepTime.parse(bad)
    with pytest.raises(ConfigError, match="--emulate-step-time"):
        EngineConfig(emulate_step_time=bad)


def test_emulated_token_is_deterministic_and_never_eos_or_special() -> None:
    toks = {emulated_token(p, t, 1000, eos=None) for p in range(50) for t in range(50)}
    assert min(toks) >= 100 and max(toks) < 1000
    assert emulated_token(7, 3, 1000, None) == emulated_token(7, 3, 1000, None)
    hit = emulated_token(7, 3, 1000, None)
    assert emulated_token(7, 3, 1000, eos=hit) != hit


def _runner(k: int = 0) -> tuple[EmulatedRunner, list[float]]:
    slept: list[float] = []
    cfg = SimpleNamespace(vocab_size=1000, eos_token_id=[2])
    real = SimpleNamespace(
        lm=SimpleNamespace(model_config=cfg),
        cache="cache",
        dummy=None,
        samples=True,
        k=k,
        inputs=lambda sched, prepared: None,
        prepare_s=0.0,
    )
    # a clock that moves only by the sleeps: the sleep is the whole step time
    now = [0.0]

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    runner = EmulatedRunner(real, StepTime(10, 1, 0.5), sleep=sleep, clock=lambda: now[0])  # type: ignore[arg-type]
    return runner, slept


def test_a_step_ends_at_its_deadline_from_the_device_start() -> None:
    """Host work after the inputs (handing the last step's results over, the tokens) is
    inside the step's window; a sleep that returns early sleeps again, one that returns late
    is not made up for (the device never ends early, nothing spins)."""
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:  # wakes early by 1 ms once, then 0.3 ms late
        slept.append(s)
        now[0] += s - 1e-3 if len(slept) == 1 else s + 3e-4

    real = SimpleNamespace(
        lm=SimpleNamespace(model_config=SimpleNamespace(vocab_size=1000, eos_token_id=2)),
        cache=None,
        dummy=None,
        samples=True,
        k=0,
        inputs=lambda sched, prepared: now.__setitem__(0, now[0] + 2e-3),  # 2 ms of host
        prepare_s=0.0,
    )
    r = EmulatedRunner(real, StepTime(10, 0, 0), sleep=sleep, clock=lambda: now[0])  # type: ignore[arg-type]
    calls: list[float] = []

    def started() -> None:
        calls.append(now[0])
        now[0] += 4e-3  # 4 ms of the core's work on this thread: inside the window

    r.execute(SchedulerOutput([_req("a", [5], 3)], [], [], 1), started=started)
    assert calls == [pytest.approx(2e-3)]  # once the inputs are in
    assert slept == [pytest.approx(6e-3), pytest.approx(1e-3)]
    assert now[0] == pytest.approx(12e-3 + 3e-4)  # 2 ms inputs + 10 ms step + 0.3 ms late


def _req(
    rid: str, tokens: list[int], ctx: int, spec: int = 0, sample: bool = True
) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, ctx, spec, [0], 0, sample, None, SamplingParams(), 0)


def test_a_step_sleeps_its_batch_time_and_samples_the_chain() -> None:
    r, slept = _runner()
    prompt = [11, 12, 13, 14]
    chunk = _req("a", prompt[:2], 0, sample=False)  # a prefill chunk that does not sample yet
    last = _req("b", prompt, 0)
    out = r.execute(SchedulerOutput([chunk, last], [], [], 6))
    assert slept == [pytest.approx((10 + 2 * 1 + 6 * 0.5) / 1e3)]
    assert set(out) == {"b"}
    first = emulated_token(4, 14, 1000, 2)
    assert out["b"].token_ids == [first] and out["b"].draft_ids == []
    # the decode step after it continues the same chain (what a remote decode engine does)
    out2 = r.execute(SchedulerOutput([_req("b", [first], 4)], [], [], 1))
    assert out2["b"].token_ids == [emulated_token(5, first, 1000, 2)]
    assert r.execute(SchedulerOutput([], [], [], 0)) == {} and len(slept) == 2


def test_drafts_of_the_chain_are_accepted_and_a_wrong_one_stops_verification() -> None:
    r, _ = _runner(k=2)
    t5 = emulated_token(5, 40, 1000, 2)
    t6 = emulated_token(6, t5, 1000, 2)
    t7 = emulated_token(7, t6, 1000, 2)
    # inputs: the last token (position 4) then drafts for positions 5 and 6
    ok = r.execute(SchedulerOutput([_req("a", [40, t5, t6], 4, spec=2)], [], [], 3))["a"]
    assert ok.token_ids == [t5, t6, t7]
    t8 = emulated_token(8, t7, 1000, 2)
    assert ok.draft_ids == [t8, emulated_token(9, t8, 1000, 2)]
    wrong = r.execute(SchedulerOutput([_req("a", [40, t5 + 1, t6], 4, spec=2)], [], [], 3))["a"]
    assert wrong.token_ids == [t5]
    assert wrong.draft_ids[0] == t6


def test_the_steps_chain_is_emulated_tokens_through_eos_and_rejections() -> None:
    """The step's inlined arithmetic is ``emulated_token``'s: over many requests, drafts
    right and wrong, and a vocabulary so small that the chain hits the eos id often."""
    import random

    rng = random.Random(7)
    for k in (0, 1, 3):
        r, _ = _runner(k=k)
        r.vocab_size, r.eos = 110, 105  # a span of 10 ids: eos is hit every ~10 tokens

        def tok(p: int, t: int) -> int:
            return emulated_token(p, t, 110, 105)

        sched, want = [], {}
        for i in range(200):
            ctx, spec = rng.randrange(50), rng.randrange(k + 1)
            ids = [rng.randrange(100, 110)]
            for j in range(spec):  # mostly the chain's next token, sometimes not
                right = tok(ctx + j + 1, ids[-1])
                ids.append(right if rng.random() < 0.8 else 100 + (right - 99) % 10)
            sched.append(_req(f"r{i}", ids, ctx, spec=spec))
            toks: list[int] = []
            for j in range(len(ids)):  # the reference: verify, stop at the first wrong draft
                toks.append(tok(ctx + j + 1, ids[j]))
                if j + 1 >= len(ids) or ids[j + 1] != toks[-1]:
                    break
            drafts, pos = [toks[-1]], ctx + len(toks) + 1
            for _ in range(k):
                drafts.append(tok(pos, drafts[-1]))
                pos += 1
            want[f"r{i}"] = (toks, drafts[1:])
        got = r.execute(SchedulerOutput(sched, [], [], 1))
        assert {rid: (x.token_ids, x.draft_ids) for rid, x in got.items()} == want
        # the chain's raw id hits eos (and moves past it) in this range
        assert any(100 + (t * 1_000_003 + p * 7_919) % 10 == 105 for p in range(50) for t in ids)


def test_an_emulated_core_runs_one_torch_thread_unless_told() -> None:
    from dsv4_serving.engine.engine.core_process import core_threads

    emulated = EngineConfig(model="dsv4-tiny", emulate_step_time="10,0,0")
    assert core_threads(emulated, 16) == 1
    assert core_threads(replace(emulated, threads_per_rank=3), 16) == 3
    assert core_threads(EngineConfig(model="dsv4-tiny"), 16) == 0  # torch's own default
    assert core_threads(EngineConfig(model="dsv4-tiny", tensor_parallel_size=2), 16) == 8
