"""Inputs prepared ahead (async scheduling, ``ModelRunner.prepare_ahead``): once the step
thread filled the placeholders, the token ids and attention metadata equal those the runner
prepares from the filled step, and block-table rows are written only on the core's thread."""

from __future__ import annotations

import torch

from dsv4_serving.engine.core.sched.async_scheduler import PLACEHOLDER
from dsv4_serving.engine.core.sched.scheduler import (
    RunnerResult,
    ScheduledRequest,
    SchedulerOutput,
)
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.worker.block_table import BlockTable
from dsv4_serving.engine.worker.model_runner import ModelRunner
from dsv4_serving.engine.worker.step_thread import fill_placeholders

BS = 4


def _runner(k: int = 0) -> ModelRunner:
    # the parts of the runner its input preparation uses (no model: pure host logic)
    r = ModelRunner.__new__(ModelRunner)
    r.block_table, r.block_size, r.device, r.k, r.prepare_s = BlockTable(8), BS, "cpu", k, 0.0
    return r


def _req(rid: str, ids: list[int], ctx: int, blocks: list[int], slot: int) -> ScheduledRequest:
    return ScheduledRequest(rid, ids, ctx, 0, blocks, slot, True, None, SamplingParams(), 3)


def _step() -> tuple[SchedulerOutput, SchedulerOutput]:
    prev = SchedulerOutput([_req("a", [5], 6, [1, 2], 0), _req("c", [9], 3, [7], 2)], [], [], 2)
    out = SchedulerOutput(
        [
            _req("a", [PLACEHOLDER], 7, [1, 2], 0),
            _req("b", [11, 12, 13, 14, 15], 0, [3, 4], 1),  # a prefill chunk: known ids
            _req("c", [PLACEHOLDER], 4, [7, 8], 2),  # a new block this step
        ],
        [],
        [],
        7,
    )
    return prev, out


def test_prepared_ahead_then_filled_equals_prepared_after_the_fill() -> None:
    prev, out = _step()
    r = _runner()
    ahead = r.prepare_ahead(out)
    assert ahead is not None and ahead.holders == [0, 2] and ahead.rows.tolist() == [0, 6]
    written = r.block_table.rows_written
    fill_placeholders(out, prev, {"a": RunnerResult([40]), "c": RunnerResult([41])})
    ids, meta = r.inputs(out.scheduled, ahead)
    assert r.block_table.rows_written == written  # the fill writes no block-table row
    assert ids.tolist() == [40, 11, 12, 13, 14, 15, 41]
    want_ids, want = _runner().prepare(out.scheduled)
    assert torch.equal(ids, want_ids)
    assert meta.query_start_loc == want.query_start_loc
    assert meta.context_lens == want.context_lens
    assert torch.equal(meta.positions, want.positions)
    assert torch.equal(meta.block_tables, want.block_tables)
    assert meta.block_tables.tolist() == [[1, 2], [3, 4], [7, 8]]


def test_mtp_steps_and_empty_steps_prepare_on_the_step_thread() -> None:
    _, out = _step()
    assert _runner(k=1).prepare_ahead(out) is None
    assert _runner().prepare_ahead(SchedulerOutput([], [], [], 0)) is None
