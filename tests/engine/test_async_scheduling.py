"""Async scheduling (``--async-scheduling``) gives every request exactly the greedy tokens of the
synchronous engine: batched, chunked, preempted and prefix-cached runs, MTP drafts (rejected
ones on the random-weight models, accepted ones on the pass-through checkpoint), stops found
one step late (the extra tokens never emitted), aborts mid-flight, seeded sampling, grammars
(structured outputs), the EMULATED runner; and every block and state slot is free again
afterwards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.request import EngineCoreRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.structured.spec import GrammarKind, GrammarSpec

from .common import alone, pass_through_checkpoint, run, workload

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


Refs = Callable[[str, str], dict[int, list[int]]]


@pytest.fixture(scope="module")
def reference() -> Refs:
    """Each request alone, synchronously: ``reference(model, "mixed" | "shared")``, computed
    at its first use (one test id alone computes only its own)."""
    refs: dict[tuple[str, str], dict[int, list[int]]] = {}

    def get(model: str, work: str) -> dict[int, list[int]]:
        if (model, work) not in refs:
            one = replace(SYNC[model], max_num_seqs=1, enable_prefix_caching=False)
            items = workload(N, 1) if work == "mixed" else workload(N, 2, SHARED)
            refs[model, work] = alone(one, items)
        return refs[model, work]

    return get


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
    ("mtp1-prefix", "dsv4-tiny", {"num_speculative_tokens": 1}, "shared", 2),
    (
        "mtp3-chunk29-preempt",
        "dsv4-tiny",
        {"num_speculative_tokens": 3, "max_num_batched_tokens": 29, "num_kv_blocks": 27},
        "mixed",
        1,
    ),
    (
        "mtp2-chunk45-preempt",
        "dsv3-small",
        {"num_speculative_tokens": 2, "max_num_batched_tokens": 45, "num_kv_blocks": 40},
        "mixed",
        1,
    ),
]


@pytest.mark.parametrize(
    ("name", "model", "over", "work", "waves"), CASES, ids=[f"{c[1]}-{c[0]}" for c in CASES]
)
def test_async_tokens_equal_tokens_alone(
    reference: Refs,
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
    want = reference(model, work)
    bad = [i for i in range(N) if got[i] != want[i]]
    assert not bad, f"{len(bad)} requests differ, e.g. #{bad[0]}: {got[bad[0]]} vs {want[bad[0]]}"
    assert_all_free(core, free0, slots0)
    st = core.stats()
    if "preempt" in name:
        assert st.num_preemptions > 0
    if work == "shared":
        assert st.prefix_hits >= (N // 2) * (SHARED // core.info.block_size) * core.info.block_size
    if core.info.num_speculative_tokens:
        assert st.spec_draft_tokens > 0


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


@pytest.mark.parametrize("k", [0, 2])
def test_stops_found_a_step_late_and_aborts_emit_nothing_extra(reference: Refs, k: int) -> None:
    """A stop token (EOS's path) found in step N's outputs, after step N+1 was scheduled with
    that request: the tokens N+1 made for it are never sent and its blocks and slot come back.
    Aborted requests send nothing after their abort. ``k``: MTP drafts."""
    want = reference("dsv4-tiny", "mixed")
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
    core = async_core(
        "dsv4-tiny", max_num_batched_tokens=61, num_kv_blocks=60, num_speculative_tokens=k
    )
    free0, slots0 = core.kv.num_free_blocks, core.kv.num_free_slots
    try:
        got, reasons = _drive(core, params, abort_at)
    finally:
        core.close()
    for i in range(N):
        if i in abort_at:  # (with drafts a step may bring more than one token)
            assert got[i] == expect[i][: len(got[i])] and len(got[i]) >= 2, i
            assert reasons[i] == "abort", i
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


@pytest.mark.parametrize("k", [0, 2])
def test_emulated_async_equals_emulated_sync(k: int) -> None:
    """The EMULATED runner's drafts are right: MTP with every draft accepted."""
    emu = {"emulate_step_time": "2,0,0", "max_num_batched_tokens": 61, "num_speculative_tokens": k}
    items = workload(N, 1)
    sync = EngineCore(replace(SYNC["dsv4-tiny"], **emu))  # type: ignore[arg-type]
    try:
        want = run(sync, items)
    finally:
        sync.close()
    core = async_core("dsv4-tiny", **emu)  # type: ignore[arg-type]
    try:
        got = run(core, items)
        st = core.stats()
    finally:
        core.close()
    assert got == want
    if k:
        assert st.spec_accepted_tokens == st.spec_draft_tokens > 0


def test_accepted_drafts_give_the_tokens_alone(tmp_path: Path) -> None:
    """The pass-through checkpoint's drafts are right (nearly always accepted): step N+1 runs
    where all of N's drafts took it, with N's drafts as its inputs."""
    pass_through_checkpoint(tmp_path)
    base = EngineConfig(
        model=str(tmp_path), max_model_len=256, num_kv_blocks=400, num_speculative_tokens=0
    )
    work = workload(8, 3)
    want = alone(replace(base, max_num_seqs=1, enable_prefix_caching=False), work)
    core = EngineCore(replace(base, num_speculative_tokens=3, max_num_batched_tokens=40))
    assert core.async_scheduling  # auto: on with MTP
    try:
        got = run(core, work)
        st = core.stats()
    finally:
        core.close()
    assert got == want
    assert st.spec_accepted_tokens / st.spec_draft_tokens > 0.9
    assert core.kv.num_free_blocks == 400


def test_grammar_requests_equal_the_synchronous_engine() -> None:
    """A grammar's mask for step N+1 needs N's token: the matcher lives on the step thread and
    advances there after N, before N+1's mask; drafts it refuses are cut. Greedy tokens of
    grammar requests (mixed with free ones) equal the synchronous engine's without drafts."""
    spec = GrammarSpec(GrammarKind.REGEX, "structured_outputs.regex", grammar="[a-f0-9 ]{4,40}x")
    params = {
        i: SamplingParams(
            temperature=0,
            max_tokens=3 + 3 * i,
            ignore_eos=not i % 2,  # a grammar request may end on EOS, found a step late
            structured=spec if i % 2 else None,
        )
        for i in range(8)
    }
    sync = EngineCore(SYNC["dsv4-tiny"])
    try:
        want, _ = _drive(sync, params, {})
    finally:
        sync.close()
    core = async_core("dsv4-tiny", num_speculative_tokens=2)
    try:
        got, _ = _drive(core, params, {})
    finally:
        core.close()
    assert got == want


def test_auto_is_on_with_mtp() -> None:
    core = EngineCore(replace(SYNC["dsv4-tiny"], num_speculative_tokens=1, async_scheduling="auto"))
    try:
        assert core.async_scheduling and core.steps is not None
    finally:
        core.close()
