"""The device-step seam for graphs (``engine/worker/step_graphs.py``): the padding buckets, the
pad plan (which pads, which scratch blocks and slots), the padded inputs, the per-shape
callables, and the graph platforms' fail-fast; exact values throughout."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.engine.core.sched.output import ScheduledRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.worker.step_graphs import (
    DecodeShape,
    Lane,
    PadPlan,
    StepGraphs,
    bucket_for,
    capture_for,
    eager,
    num_lanes,
    pad_inputs,
    padding_buckets,
    plan_padding,
    uniform_decode,
)

BS = 16


def test_buckets_are_vllms_capture_sizes_up_to_max_num_seqs() -> None:
    assert padding_buckets(1) == (1,)
    assert padding_buckets(3) == (1, 2, 3)
    assert padding_buckets(13) == (1, 2, 4, 8, 13)
    assert padding_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    b256 = padding_buckets(256)
    assert b256[:5] == (1, 2, 4, 8, 16) and b256[-3:] == (240, 248, 256) and len(b256) == 35
    assert padding_buckets(300)[-5:] == (248, 256, 272, 288, 300)
    with pytest.raises(ValueError):
        padding_buckets(0)


def test_bucket_for_is_the_smallest_holding_bucket() -> None:
    b = padding_buckets(64)
    assert [bucket_for(n, b) for n in (1, 2, 3, 4, 5, 8, 9, 13, 17, 63, 64)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        24,
        64,
        64,
    ]
    for bad in (0, 65):
        with pytest.raises(ValueError):
            bucket_for(bad, b)


def test_lanes_cover_the_largest_gap() -> None:
    assert num_lanes(padding_buckets(1)) == 0
    assert num_lanes(padding_buckets(2)) == 0
    assert num_lanes(padding_buckets(4)) == 1  # 3 -> 4
    assert num_lanes(padding_buckets(13)) == 4  # 9 -> 13
    assert num_lanes(padding_buckets(64)) == 7  # 9 -> 16, 17 -> 24, ...
    assert num_lanes(padding_buckets(256)) == 7
    assert num_lanes(padding_buckets(512)) == 15  # every 16 past 256


LANES = [Lane(100 + j, 50 + j) for j in range(7)]


def test_plan_takes_the_first_lanes_for_the_pads() -> None:
    b = padding_buckets(64)
    plan = plan_padding(5, 2, b, LANES, [0, 3, 7, 1, 2], 99)
    assert plan == PadPlan(DecodeShape(8, 2), (Lane(100, 50), Lane(101, 51), Lane(102, 52)))
    assert plan.shape.rows == 16
    assert plan_padding(8, 1, b, LANES, list(range(8)), 0).lanes == ()
    assert plan_padding(17, 1, b, LANES, list(range(17)), 9).lanes == tuple(LANES)


def test_plan_refuses_a_real_sequence_on_a_lane() -> None:
    b = padding_buckets(64)
    with pytest.raises(AssertionError, match="pad lane"):
        plan_padding(3, 1, b, LANES, [0, 1, 50], 10)  # a real request on slot 50
    with pytest.raises(AssertionError, match="pad lane"):
        plan_padding(3, 1, b, LANES, [0, 1, 2], 100)  # a real block table naming block 100
    with pytest.raises(AssertionError, match="lanes reserved"):
        plan_padding(9, 1, b, LANES[:3], list(range(9)), 0)


def _req(n: int, ctx: int, slot: int, sample: bool = True) -> ScheduledRequest:
    blocks = list(range(slot * 4, slot * 4 + 1 + (ctx + n) // BS))
    return ScheduledRequest(
        str(slot), [7] * n, ctx, n - 1, blocks, slot, sample, None, SamplingParams(), 1
    )


def test_uniform_decode_is_every_request_adding_its_token_and_all_drafts() -> None:
    assert uniform_decode([_req(2, 5, 0), _req(2, 30, 1)], 2)
    assert not uniform_decode([_req(2, 5, 0), _req(1, 30, 1)], 2)  # one without drafts
    assert not uniform_decode([_req(2, 5, 0, sample=False)], 2)  # a prefill chunk
    snap = _req(2, 15, 0)
    snap.snapshots.append((16, 9))
    assert not uniform_decode([snap], 2)


def _meta(sched: list[ScheduledRequest]) -> AttentionMetadata:
    chunks = [SeqChunk(s.context_len, len(s.token_ids), s.block_ids, s.state_slot) for s in sched]
    return AttentionMetadata.build(chunks, BS)


def test_padded_inputs_are_fresh_sequences_on_their_lanes() -> None:
    sched = [_req(2, 5, 0), _req(2, 20, 1), _req(2, 40, 2)]
    meta = _meta(sched)
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    plan = PadPlan(DecodeShape(4, 2), (Lane(100, 50),))
    pids, pmeta = pad_inputs(ids, meta, plan)
    assert pids.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert pmeta.query_start_loc == [0, 2, 4, 6, 8]
    assert pmeta.context_lens == [5, 20, 40, 0]
    assert pmeta.positions.tolist() == [5, 6, 20, 21, 40, 41, 0, 1]
    assert pmeta.block_tables.tolist() == [[0, 0, 0], [4, 5, 0], [8, 9, 10], [100, 0, 0]]
    assert pmeta.num_blocks == [1, 2, 3, 1]
    assert pmeta.state_slots == [0, 1, 2, 50]
    # the real step's metadata is untouched (the sampler and the drafter read it)
    assert meta.query_start_loc == [0, 2, 4, 6] and meta.positions.tolist() == [
        5,
        6,
        20,
        21,
        40,
        41,
    ]
    assert pad_inputs(ids, meta, PadPlan(DecodeShape(3, 2), ())) == (ids, meta)


def test_seam_runs_each_shape_by_its_callable_and_drops_the_pads() -> None:
    seen: list[tuple[int, list[int]]] = []
    made: list[DecodeShape] = []

    def forward(ids: torch.Tensor, meta: AttentionMetadata, cache: object) -> torch.Tensor:
        seen.append((ids.numel(), list(meta.state_slots)))
        return ids.float().unsqueeze(1) * 10

    def capture(shape: DecodeShape, fn):  # type: ignore[no-untyped-def]
        made.append(shape)
        return fn

    g = StepGraphs(forward, padding_buckets(8), LANES[:3], 1, BS, capture)
    sched = [_req(1, 3, 0), _req(1, 9, 1), _req(1, 4, 2)]
    out = g.step(sched, torch.tensor([1, 2, 3]), _meta(sched), None)
    assert out.flatten().tolist() == [10.0, 20.0, 30.0]  # the pad's row dropped
    assert seen[-1] == (4, [0, 1, 2, 50])
    g.step(sched[:2], torch.tensor([1, 2]), _meta(sched[:2]), None)
    g.step(sched, torch.tensor([1, 2, 3]), _meta(sched), None)
    assert made == [DecodeShape(4, 1), DecodeShape(2, 1)]  # captured once per shape
    assert (g.padded_steps, g.pad_rows) == (3, 2)
    mixed = [_req(1, 3, 0), _req(5, 0, 1, sample=False)]
    g.step(mixed, torch.arange(6), _meta(mixed), None)  # a prefill chunk: eager, unpadded
    assert seen[-1] == (6, [0, 1]) and g.padded_steps == 3


def test_graph_platforms_fail_fast_naming_their_hardware() -> None:
    assert capture_for("eager", "cpu") is eager
    with pytest.raises(ConfigError, match="needs a CUDA device, and this engine runs on cpu"):
        capture_for("cuda", "cpu")
    with pytest.raises(ConfigError, match="needs an Ascend NPU, and this engine runs on cpu"):
        capture_for("npu", "cpu")
    with pytest.raises(ConfigError, match="not built yet"):
        capture_for("cuda", "cuda")
    with pytest.raises(ConfigError, match="step_graphs must be"):
        EngineConfig(step_graphs="always")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--emulate-step-time"):
        EngineConfig(step_graphs="eager", emulate_step_time="10,0,0")
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        EngineConfig(step_graphs="eager", context_parallel_size=2)
