"""Async scheduling (``--async-scheduling``) gives every request exactly the greedy tokens of the
synchronous engine: batched, chunked, preempted and prefix-cached runs, stops found one step
late (the extra token never emitted), aborts mid-flight, seeded sampling, the EMULATED runner;
and every block and state slot is free again afterwards. Where it is not exact (MTP) the
engine steps synchronously."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.request import EngineCoreRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams

from .common import alone, run, workload

N = 24
SHARED = 50
SYNC = {
    "dsv4-tiny": EngineConfig(
        model="dsv4-tiny",
        max_model_len=384,
        num_kv_blocks=1200,
        max_num_seqs=48,
        num_speculative_tokens=0,
        async_scheduling="off",
    ),
    "dsv3-small": EngineConfig(
        model="dsv3-small",
        max_model_len=384,
        num_kv_blocks=1200,
        max_num_seqs=48,
        num_speculative_tokens=0,
        async_scheduling="off",
    ),
}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, dict[int, list[int]]]]:
    refs: dict[str, dict[str, dict[int, list[int]]]] = {}
    for name, cfg in SYNC.items():
        one = replace(cfg, max_num_seqs=1, enable_prefix_caching=False)
        refs[name] = {"mixed": alone(one, workload(N, 1))}
        if name == "dsv4-tiny":
            refs[name]["shared"] = alone(one, workload(N, 2, SHARED))
    return refs


def async_core(model: str, **over: int | bool) -> EngineCore:
    core = EngineCore(replace(SYNC[model], async_scheduling="on", **over))  # type: ignore[arg-type]
    assert core.async_scheduling and core.steps is not None
    return core


def assert_all_free(core: EngineCore, blocks: int, slots: int) -> None:
    assert not core.has_unfinished_requests()
    assert core.kv.num_free_blocks == blocks and core.kv.num_free_slots == slots
    assert core.stats().num_free_blocks == blocks


CASES = [
    ("batched", "dsv4-tiny", {"enable_prefix_caching": False}, "mixed", 1),
    (
        "chunk7",
        "dsv4-tiny",
        {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
        "mixed",
        1,
    ),
    (
        "chunk61-preempt",
        "dsv4-tiny",
        {"max_num_batched_tokens": 61, "num_kv_blocks": 40},
        "mixed",
        1,
    ),
    ("prefix", "dsv4-tiny", {"max_num_batched_tokens": 100}, "shared", 2),
    (
        "batched-preempt",
        "dsv3-small",
        {"max_num_batched_tokens": 45, "num_kv_blocks": 40},
        "mixed",
        1,
    ),
]


@pytest.mark.parametrize(
    ("name", "model", "over", "work", "waves"), CASES, ids=[f"{c[1]}-{c[0]}" for c in CASES]
)
def test_async_tokens_equal_tokens_alone(
    reference: dict[str, dict[str, dict[int, list[int]]]],
    name: str,
    model: str,
    over: dict[str, int | bool],
    work: str,
    waves: int,
) -> None:
    core = async_core(model, **over)
    free0, slots0 = core.kv.num_free_blocks, core.kv.num_free_slots
    items = workload(N, 1) if work == "mixed" else workload(N, 2, SHARED)
    try:
        got = run(core, items, waves)
    finally:
        core.close()
    want = reference[model][work]
    bad = [i for i in range(N) if got[i] != want[i]]
    assert not bad, f"{len(bad)} requests differ, e.g. #{bad[0]}: {got[bad[0]]} vs {want[bad[0]]}"
    assert_all_free(core, free0, slots0)
    st = core.stats()
    if "preempt" in name:
        assert st.num_preemptions > 0
    if work == "shared":
        assert st.prefix_hits >= (N // 2) * (SHARED // core.info.block_size) * core.info.block_size


def _drive(core: EngineCore, params: dict[int, SamplingParams], abort_at: dict[int, int]):  # type: ignore[no-untyped-def]
    """Run every request; request i is aborted once it has ``abort_at[i]`` tokens. Returns
    the tokens and finish reasons each request was sent."""
    items = workload(N, 1)
    got: dict[int, list[int]] = {i: [] for i in params}
    reasons: dict[int, str | None] = {}
    for i, sp in params.items():
        core.add_request(EngineCoreRequest(str(i), items[i][0], sp))
    for _ in range(5000):
        if not core.has_unfinished_requests():
            return got, reasons
        for o in core.step():
            i = int(o.request_id)
            assert i not in reasons, f"#{i}: output after it finished: {o}"
            got[i].extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[i] = o.finish_reason
            elif i in abort_at and len(got[i]) >= abort_at[i]:
                core.abort_requests([str(i)])
                reasons[i] = "abort"
    raise AssertionError("requests did not finish")


def test_stops_found_a_step_late_and_aborts_emit_nothing_extra(
    reference: dict[str, dict[str, dict[int, list[int]]]],
) -> None:
    """A stop token (EOS's path) found in step N's outputs, after step N+1 was scheduled with
    that request: the token N+1 made for it is never sent and its blocks and slot come back.
    Aborted requests send nothing after their abort."""
    want = reference["dsv4-tiny"]["mixed"]
    items = workload(N, 1)
    params: dict[int, SamplingParams] = {}
    abort_at: dict[int, int] = {}
    expect: dict[int, list[int]] = {}
    for i in range(N):
        w = want[i]
        mt = items[i][1]
        if i % 3 == 0 and len(w) > 2:  # stop on a token mid-way
            stop = w[1 + i % (len(w) - 2)]
            params[i] = SamplingParams(
                temperature=0, max_tokens=mt, ignore_eos=True, stop_token_ids=[stop]
            )
            expect[i] = w[: w.index(stop) + 1]
        else:
            params[i] = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
            expect[i] = w
            if i % 3 == 1 and len(w) > 2:
                abort_at[i] = 2
    core = async_core("dsv4-tiny", max_num_batched_tokens=61, num_kv_blocks=60)
    free0, slots0 = core.kv.num_free_blocks, core.kv.num_free_slots
    try:
        got, reasons = _drive(core, params, abort_at)
    finally:
        core.close()
    for i in range(N):
        if i in abort_at:
            assert got[i] == expect[i][:2] and reasons[i] == "abort", i
        else:
            assert got[i] == expect[i], (i, got[i], expect[i])
            stopped = params[i].stop_token_ids and len(expect[i]) < items[i][1]
            assert reasons[i] == ("stop" if stopped else "length"), i
    assert_all_free(core, free0, slots0)


def test_seeded_sampling_equals_the_synchronous_engine() -> None:
    """The step thread keeps each request's generator and penalty counts in step order."""
    params = {
        i: SamplingParams(
            temperature=0.9,
            top_p=0.9,
            seed=100 + i,
            max_tokens=6,
            ignore_eos=True,
            presence_penalty=0.5 if i % 2 else 0.0,
        )
        for i in range(8)
    }
    sync = EngineCore(SYNC["dsv4-tiny"])
    try:
        want, _ = _drive(sync, params, {})
    finally:
        sync.close()
    core = async_core("dsv4-tiny")
    try:
        got, _ = _drive(core, params, {})
    finally:
        core.close()
    assert got == want


def test_emulated_async_equals_emulated_sync() -> None:
    emu = {"emulate_step_time": "2,0,0", "max_num_batched_tokens": 61}
    items = workload(N, 1)
    sync = EngineCore(replace(SYNC["dsv4-tiny"], **emu))  # type: ignore[arg-type]
    try:
        want = run(sync, items)
    finally:
        sync.close()
    core = async_core("dsv4-tiny", **emu)  # type: ignore[arg-type]
    try:
        got = run(core, items)
    finally:
        core.close()
    assert got == want


def test_mtp_steps_synchronously_under_auto() -> None:
    core = EngineCore(replace(SYNC["dsv4-tiny"], num_speculative_tokens=1, async_scheduling="auto"))
    try:
        assert not core.async_scheduling and core.steps is None
    finally:
        core.close()
    with pytest.raises(ValueError, match="MTP"):
        EngineCore(replace(SYNC["dsv4-tiny"], num_speculative_tokens=-1, async_scheduling="on"))
