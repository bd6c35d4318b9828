"""Continuous batching, chunked prefill, preemption, prefix caching and MTP give every request
exactly the greedy tokens it gets alone (32+ concurrent requests of mixed lengths), and every
block and state slot is free again afterwards."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.core.sched.prefill_order import StepCost
from dsv4_serving.engine.engine.engine_core import EngineCore

from .common import alone, run, workload

N = 34
BASE = {
    "dsv4-tiny": EngineConfig(
        model="dsv4-tiny",
        max_model_len=384,
        num_kv_blocks=1200,
        max_num_seqs=48,
        num_speculative_tokens=0,
        async_scheduling="off",  # the synchronous engine: test_async*.py cover async
    ),
    "dsv3-small": EngineConfig(
        model="dsv3-small",
        max_model_len=384,
        num_kv_blocks=1200,
        max_num_seqs=48,
        num_speculative_tokens=0,
        async_scheduling="off",  # the synchronous engine: test_async*.py cover async
    ),
}
SHARED = 50  # tokens of common prefix in the prefix-caching workload


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, dict[int, list[int]]]]:
    refs: dict[str, dict[str, dict[int, list[int]]]] = {}
    for name, cfg in BASE.items():
        one = replace(cfg, max_num_seqs=1, enable_prefix_caching=False)
        refs[name] = {
            "mixed": alone(one, workload(N, 1)),
            "shared": alone(one, workload(N, 2, SHARED)),
        }
    return refs


CASES = [
    # (id, model, overrides, workload, waves)
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
    ("mtp1-prefix", "dsv4-tiny", {"num_speculative_tokens": 1}, "shared", 2),
    (
        "mtp3-chunk29-preempt",
        "dsv4-tiny",
        {"num_speculative_tokens": 3, "max_num_batched_tokens": 29, "num_kv_blocks": 27},
        "mixed",
        1,
    ),
    ("batched", "dsv3-small", {"max_num_batched_tokens": 45, "num_kv_blocks": 40}, "mixed", 1),
    ("prefix-mtp2", "dsv3-small", {"num_speculative_tokens": 2}, "shared", 2),
]


@pytest.mark.parametrize(
    ("name", "model", "over", "work", "waves"), CASES, ids=[f"{c[1]}-{c[0]}" for c in CASES]
)
def test_scheduled_tokens_equal_tokens_alone(
    reference: dict[str, dict[str, dict[int, list[int]]]],
    name: str,
    model: str,
    over: dict[str, int | bool],
    work: str,
    waves: int,
) -> None:
    core = EngineCore(replace(BASE[model], **over))
    free0, slots0 = core.kv.num_free_blocks, core.kv.num_free_slots
    items = workload(N, 1) if work == "mixed" else workload(N, 2, SHARED)
    got = run(core, items, waves)
    want = reference[model][work]
    bad = [i for i in range(N) if got[i] != want[i]]
    assert not bad, f"{len(bad)} requests differ, e.g. #{bad[0]}: {got[bad[0]]} vs {want[bad[0]]}"
    st = core.stats()
    assert core.kv.num_free_blocks == free0 == st.num_free_blocks
    assert core.kv.num_free_slots == slots0
    if "preempt" in name:
        assert st.num_preemptions > 0
    if work == "shared":
        assert st.prefix_hits >= (N // 2) * (SHARED // core.info.block_size) * core.info.block_size
    if core.info.num_speculative_tokens:
        assert st.spec_draft_tokens > 0


class _Known:
    def __init__(self, cost: StepCost) -> None:
        self.cost = cost

    def observe(self, seconds: float, num_tokens: int) -> None:
        pass


def test_prompts_ordered_by_deadline_give_the_tokens_alone(
    reference: dict[str, dict[str, dict[int, list[int]]]],
) -> None:
    """The SLO-aware order (``--prompt-deadline``) only changes which prompts share a step:
    the greedy tokens stay each request's own, and every block and slot comes back."""
    over = {"max_num_batched_tokens": 61, "num_kv_blocks": 40, "enable_prefix_caching": False}
    core = EngineCore(replace(BASE["dsv4-tiny"], prompt_deadline=0.3, **over))
    # a fixed speed (10 ms a token: 30 tokens fit a deadline), so the order does not depend on
    # how fast this machine is: the longer prompts of the first wave go behind the short ones
    core.scheduler.step_cost = _Known(StepCost(0.0, 0.01))  # type: ignore[assignment]
    free0, slots0 = core.kv.num_free_blocks, core.kv.num_free_slots
    got = run(core, workload(N, 1))
    want = reference["dsv4-tiny"]["mixed"]
    bad = [i for i in range(N) if got[i] != want[i]]
    assert not bad, f"{len(bad)} requests differ, e.g. #{bad[0]}: {got[bad[0]]} vs {want[bad[0]]}"
    st = core.stats()
    assert st.num_late_prompts > 0
    assert core.kv.num_free_blocks == free0 and core.kv.num_free_slots == slots0
