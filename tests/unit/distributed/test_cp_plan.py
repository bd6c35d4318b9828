"""The context-parallel plan (``distributed/cp_plan.py``): zig-zag split boundaries, chunks
too short to split, balanced causal work (against brute-force key visits), and the per-rank
bytes for V4-Flash (the gathered totals are the communication table of docs/long-context.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsv4_serving.distributed.cp_plan import (
    CPLayer,
    CPModel,
    CPPlan,
    key_visits,
    local_rows,
    split_chunk,
)
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.presets.configs import shape_config

pytestmark = pytest.mark.unit

FLASH = CPModel.v4(DeepseekV4Config.from_dict(shape_config("deepseek-v4-flash")))
SMALL_V4 = CPModel(
    (CPLayer("window", 8), CPLayer("csa", 40, 4), CPLayer("hca", 24, 16), CPLayer("csa", 40, 4)),
    hidden_size=16,
    streams=4,
    window=5,
    index_topk=3,
    index_heads=2,
    dtype_bytes=4,
)
MLA = CPModel.mla(
    SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=3, hidden_size=256)
)


def spans(plan: CPPlan) -> list[tuple[tuple[int, int], ...]]:
    return [r.spans for r in plan.ranks]


def test_zigzag_gives_each_rank_a_head_and_a_tail_part_of_whole_blocks() -> None:
    # 8 blocks in 4 parts of 2; the last part ends at the prompt's end
    p = CPPlan.build(SMALL_V4, 1000, cp=2, align=128)
    assert p.split
    assert spans(p) == [((0, 256), (768, 1000)), ((256, 512), (512, 768))]
    assert [r.rows for r in p.ranks] == [488, 512]
    # 11 blocks: the first 3 parts get the extra block; after 500 cached tokens
    p = CPPlan.build(SMALL_V4, 1300, cp=2, align=128, context=500)
    assert spans(p) == [((500, 884), (1652, 1800)), ((884, 1268), (1268, 1652))]
    p = CPPlan.build(SMALL_V4, 8 * 64, cp=4, align=64)
    assert spans(p) == [
        ((0, 64), (448, 512)),
        ((64, 128), (384, 448)),
        ((128, 192), (320, 384)),
        ((192, 256), (256, 320)),
    ]


def test_a_chunk_under_two_blocks_per_rank_or_cp_1_is_not_split() -> None:
    for tokens, cp in ((300, 2), (1000, 1)):
        p = CPPlan.build(SMALL_V4, tokens, cp=cp, align=128)
        assert not p.split
        assert spans(p) == [((0, tokens),)] * cp
        assert all(r.rows == tokens for r in p.ranks)
        assert p.gathered_bytes(0) == 0 and p.gathered_buffer_bytes() == 0
    with pytest.raises(ValueError, match="cp 0"):
        CPPlan.build(SMALL_V4, 10, cp=0)


def brute_visits(model: CPModel, spans: tuple[tuple[int, int], ...]) -> int:
    total = 0
    for layer in model.layers:
        for a, b in spans:
            for t in range(a, b):
                if layer.kind == "mla":
                    total += t + 1
                    continue
                total += min(t + 1, model.window)
                entries = (t + 1) // layer.ratio if layer.ratio else 0
                if layer.kind == "csa":
                    total += min(model.index_topk, entries) + entries
                elif layer.kind == "hca":
                    total += entries
    return total


@pytest.mark.parametrize("model", [SMALL_V4, MLA])
def test_key_visits_in_closed_form_equal_the_brute_force_count(model: CPModel) -> None:
    for s in (((0, 1),), ((0, 97),), ((3, 40), (77, 200)), ((500, 884), (1652, 1800))):
        assert key_visits(model, s) == brute_visits(model, s)


def test_zigzag_balances_the_causal_work_a_contiguous_split_does_not() -> None:
    # dense causal, 8 tokens: zig-zag {0,1,6,7} and {2,3,4,5} both visit 18 keys
    p = CPPlan.build(MLA, 8, cp=2, align=1)
    assert [r.key_visits for r in p.ranks] == [18 * 3, 18 * 3]
    assert p.imbalance() == 1.0
    assert key_visits(MLA, ((0, 4),)) == 10 * 3 and key_visits(MLA, ((4, 8),)) == 26 * 3
    # V4-Flash, 128K: within 0.1% of the mean per rank; a contiguous half-split is 1.5x
    p = CPPlan.build(FLASH, 131072, cp=4)
    assert p.imbalance() < 1.001
    halves = [key_visits(FLASH, ((0, 65536),)), key_visits(FLASH, ((65536, 131072),))]
    assert max(halves) * 2 / sum(halves) > 1.4


def test_v4_flash_bytes_per_rank() -> None:
    # per token and layer (bf16): K=V 1 KiB; HCA + compressor 2 KiB; CSA + 4 KiB + indexer 1 KiB
    assert set(FLASH.layers) == {
        CPLayer("window", 512),
        CPLayer("csa", 512 * 5 + 512, 4),
        CPLayer("hca", 512 * 3, 128),
    }
    per_token = 21 * 6144 + 20 * 3072 + 2 * 1024
    p = CPPlan.build(FLASH, 131072, cp=2, kv_bytes_per_block=881 << 10, kv_bytes_per_seq=12 << 20)
    assert p.gathered_bytes(0) == 65536 * per_token == int(11.75 * 2**30)
    assert p.gathered_buffer_bytes() == 131072 * 6144
    r0 = p.ranks[0]
    assert r0.rows == 65536
    assert r0.residual_bytes == 65536 * 4096 * 4 * 2  # mHC: 4 streams
    assert r0.indexer_bytes == 65536 * 64 * (131072 // 4) * 4
    assert p.kv_bytes == 1024 * (881 << 10) + (12 << 20)  # the whole prompt, on every rank
    p8 = CPPlan.build(FLASH, 1 << 20, cp=8)
    assert p8.gathered_bytes(3) == (1 << 20) * 7 // 8 * per_token


def test_mla_gathers_its_latent_rows() -> None:
    assert MLA.layers == (CPLayer("mla", 576),) * 3
    p = CPPlan.build(MLA, 4096, cp=2)
    assert p.gathered_bytes(1) == 2048 * 3 * 576 * 2
    assert p.ranks[0].indexer_bytes == 0


def test_local_rows_split_each_prefill_chunk_of_a_flat_batch() -> None:
    # rows 0-299 (19 blocks of 16: parts of 5, 5, 5, 4 blocks, the last cut at 300), rows
    # 300-449 (10 blocks: 3, 3, 2, 2, cut at 150), rows 450-469 (2 blocks: not split)
    starts, lens = [0, 300, 450], [300, 150, 20]
    assert split_chunk(300, 2, 16) == [[(0, 80), (240, 300)], [(80, 160), (160, 240)]]
    assert local_rows(starts, lens, 2, 0, 16) == [
        (0, 80),
        (240, 300),
        (300, 348),
        (428, 450),
        (450, 470),
    ]
    assert local_rows(starts, lens, 2, 1, 16) == [
        (80, 160),
        (160, 240),
        (348, 396),
        (396, 428),
        (450, 470),
    ]
