"""The device-step seam for graphs (``--step-graphs eager``): decode steps padded to their
bucket give every request exactly the greedy tokens of the unpadded engine (no tolerance), for
batches that are not bucket sizes (3, 5, 13 requests: buckets 4, 8, 16), with MTP on and off,
synchronous and async; the pads' scratch blocks and slots are never a real request's (the pad
plan checks it every step) and every block and slot is free again afterwards; DP 2 and TP 2
give the single-process tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.worker.step_graphs import DecodeShape, StepGraphs
from tests.dist.engine_cases import near_ties, reference, serve_through_front_end

from .common import run, workload

BASE = EngineConfig(
    model="dsv4-tiny",
    max_model_len=384,
    num_kv_blocks=400,
    max_num_seqs=16,  # buckets 1, 2, 4, 8, 16: 7 pad lanes
    enable_prefix_caching=False,
)
SIZES = (3, 5, 13)


def _tokens(core: EngineCore) -> list[dict[int, list[int]]]:
    """Each batch size's requests, all at once, one batch after the other."""
    try:
        return [run(core, workload(n, 5 + n)) for n in SIZES]
    finally:
        core.close()


CASES = [
    ("dsv4-tiny", 1, "on"),
    ("dsv4-tiny", 0, "on"),
    ("dsv4-tiny", 1, "off"),
    ("dsv4-tiny", 3, "on"),
    ("dsv3-small", 1, "on"),  # MLA: paged latent rows only, no per-sequence state
]


@pytest.mark.parametrize(("model", "k", "async_scheduling"), CASES)
def test_padded_decode_gives_the_unpadded_tokens(model: str, k: int, async_scheduling: str) -> None:
    config = replace(
        BASE,
        model=model,
        num_speculative_tokens=k,
        async_scheduling=async_scheduling,  # type: ignore[arg-type]
    )
    want = _tokens(EngineCore(config))
    core = EngineCore(replace(config, step_graphs="eager"))
    graphs = core.runner.graphs
    assert isinstance(graphs, StepGraphs)
    free0, slots0 = core.kv.num_free_blocks, core.kv.num_free_slots
    got = _tokens(core)
    for n, w, g in zip(SIZES, want, got, strict=True):
        bad = [i for i in w if g[i] != w[i]]
        assert not bad, f"{n} requests, #{bad[0]}: {g[bad[0]]} vs unpadded {w[bad[0]]}"
    # the seam really padded: 13 requests decode as 16, 5 as 8, 3 as 4 (k + 1 rows each)
    assert {DecodeShape(s, 1 + k) for s in (4, 8, 16)} <= set(graphs.graphs)
    assert graphs.padded_steps > 0 and graphs.pad_rows > 0
    assert not core.has_unfinished_requests()
    assert (core.kv.num_free_blocks, core.kv.num_free_slots) == (free0, slots0)
    # the lanes lie past every block and slot the KV cache manager hands out
    assert min(lane.block for lane in graphs.lanes) >= core.info.num_kv_blocks
    assert min(lane.slot for lane in graphs.lanes) >= BASE.max_num_seqs
    assert len(graphs.lanes) == 7  # 9 running decode as 16
    paged = core.runner.cache.paged_tensors()[0]
    assert paged.shape[0] == core.info.num_kv_blocks + 7  # the lanes' blocks, reserved


def test_a_graph_platform_without_its_device_fails_at_start() -> None:
    with pytest.raises(ConfigError, match="needs a CUDA device, and this engine runs on cpu"):
        EngineCore(replace(BASE, step_graphs="cuda", device="cpu"))


@pytest.mark.parametrize(
    "sizes",
    [
        {"data_parallel_size": 2, "expert_parallel_size": 2},
        {"tensor_parallel_size": 2},
    ],
    ids=["dp2-ep2", "tp2"],
)
def test_parallel_padded_decode_gives_single_process_tokens(sizes: dict[str, int]) -> None:
    """The ranks as processes: under DP each rank pads its own decode batch and the MoE
    all-gathers its pads with its real rows; under TP every rank pads the same step on its
    own lanes. Greedy tokens are the single-process engine's (where the parallel sums' other
    order meets a near tie, the dist tier's rule applies, as for every parallel test)."""
    base = EngineConfig(
        model="dsv4-tiny",
        max_model_len=384,
        num_kv_blocks=200,
        max_num_seqs=8,
        num_speculative_tokens=1,
        threads_per_rank=1,
        enable_prefix_caching=False,
    )
    work = workload(11, 7)
    ref = reference(base, work)
    cfg = replace(base, async_scheduling="on", step_graphs="eager", **sizes)  # type: ignore[arg-type]
    got = serve_through_front_end(cfg, work, [None])
    print(f"{sizes} padded: near-tie differences {near_ties(got.tokens, ref)}")
    assert got.stats.spec_draft_tokens > 0
