"""Inputs prepared ahead (async scheduling, ``ModelRunner.prepare_ahead``): once the step
thread filled the placeholders (with MTP: moved back by the drafts the step before rejected),
the token ids and attention metadata equal those the runner prepares from the filled step, and
block-table rows are written only on the core's thread."""

from __future__ import annotations

import dataclasses

import torch

from dsv4_serving.attention.metadata import AttentionMetadata
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


def _mtp_req(rid: str, ids: list[int], ctx: int, spec: int, blocks: list[int], slot: int):  # type: ignore[no-untyped-def]
    return ScheduledRequest(rid, ids, ctx, spec, blocks, slot, True, None, SamplingParams(), 3)


def test_mtp_prepared_ahead_then_filled_moves_back_by_the_rejected_drafts() -> None:
    # k = 2: "a" verified 2 drafts at 6 (3 inputs) and N+1 was placed at 9, as if both were
    # accepted; it accepted 1, so N+1 starts at 8. "c" accepted both: it stays at 5.
    prev = SchedulerOutput(
        [_mtp_req("a", [5, 6, 7], 6, 2, [1, 2, 3], 0), _mtp_req("c", [9, 1, 2], 2, 2, [7, 8], 2)],
        [],
        [],
        6,
    )
    out = SchedulerOutput(
        [
            _mtp_req("a", [PLACEHOLDER] * 3, 9, 2, [1, 2, 3], 0),
            _mtp_req("b", [11, 12, 13, 14, 15], 0, 0, [4, 5], 1),
            _mtp_req("c", [PLACEHOLDER] * 3, 5, 2, [7, 8], 2),
        ],
        [],
        [],
        11,
    )
    r = _runner(k=2)
    ahead = r.prepare_ahead(out)
    assert ahead is not None and ahead.holders == [0, 2] and ahead.contexts == [9, 5]
    assert ahead.rows.tolist() == [0, 1, 2, 8, 9, 10]
    written = r.block_table.rows_written
    results = {
        "a": RunnerResult([6, 40], None, [41, 42]),
        "c": RunnerResult([1, 2, 50], None, [51, 52]),
    }
    fill_placeholders(out, prev, results)
    assert [s.context_len for s in out.scheduled] == [8, 0, 5]
    ids, meta = r.inputs(out.scheduled, ahead)
    assert r.block_table.rows_written == written  # the fill writes no block-table row
    assert ids.tolist() == [40, 41, 42, 11, 12, 13, 14, 15, 50, 51, 52]
    assert meta.positions.tolist() == [8, 9, 10, 0, 1, 2, 3, 4, 5, 6, 7]
    want_ids, want = _runner(k=2).prepare(out.scheduled)
    assert torch.equal(ids, want_ids)
    assert meta.context_lens == want.context_lens == [8, 0, 5]
    assert meta.seq_lens() == want.seq_lens()
    # every field of the metadata: one the fill does not move would fail here
    for f in dataclasses.fields(AttentionMetadata):
        got_v, want_v = getattr(meta, f.name), getattr(want, f.name)
        if isinstance(want_v, torch.Tensor):
            assert torch.equal(got_v, want_v), f.name
        else:
            assert got_v == want_v, f.name


def test_empty_steps_prepare_nothing() -> None:
    assert _runner().prepare_ahead(SchedulerOutput([], [], [], 0)) is None
    assert _runner(k=1).prepare_ahead(SchedulerOutput([], [], [], 0)) is None
