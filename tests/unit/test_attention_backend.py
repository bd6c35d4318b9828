"""The attention backend the layers use: which implementation the platform builds for a model
config, the clear error where none can run, and the per-step tables it builds (exact values)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dsv4_serving.attention.backends.mla_cuda import MLAFlashInfer, MLAFlashMLA
from dsv4_serving.attention.backends.mla_torch import MLAPagedKernel, MLATorch
from dsv4_serving.attention.backends.v4_torch import V4Torch
from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.attention.mla_step import MLAStep, PrefillSeq
from dsv4_serving.attention.selector import BackendUnavailable, attention_backend
from dsv4_serving.attention.v4_step import V4DecodeStep, V4Step
from dsv4_serving.models.config import DeepseekV3Config
from dsv4_serving.platform.backend import select_attention_backend
from dsv4_serving.presets.configs import preset_config

MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
V4 = {"compress_ratios": [0, 4, 128], "index_topk": 512}


def test_the_decision_lists_each_platforms_implementations() -> None:
    assert select_attention_backend(MLA, "cpu").implementations == (
        "cpu-mla-paged",
        "cpu-mla-torch",
    )
    assert select_attention_backend(MLA, "cuda").implementations == (
        "cuda-flashmla",
        "cuda-flashinfer",
    )
    npu = select_attention_backend(MLA, "npu")
    assert npu.implementations == ("npu-mla-fia",) and "split" in npu.kv_cache_kind
    assert select_attention_backend(V4, "cpu").family == "v4"
    # a parsed config decides like its config.json
    parsed = DeepseekV3Config.from_dict(preset_config("dsv3-small"))
    assert select_attention_backend(parsed, "cpu") == select_attention_backend(
        preset_config("dsv3-small"), "cpu"
    )


def test_cpu_takes_the_paged_kernel_and_pure_torch_where_it_cannot_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(MLAPagedKernel, "unavailable", classmethod(lambda cls: None))
    assert type(attention_backend(MLA, "cpu")) is MLAPagedKernel
    monkeypatch.setattr(MLAPagedKernel, "unavailable", classmethod(lambda cls: "no g++"))
    assert type(attention_backend(MLA, "cpu")) is MLATorch
    assert type(attention_backend(V4, "cpu")) is V4Torch


def test_cuda_without_its_libraries_fails_fast_naming_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(BackendUnavailable) as err:
        attention_backend(MLA, "cuda")
    msg = str(err.value)
    assert msg.startswith("attention backend cuda-mla: none of its implementations can run here")
    assert "cuda-flashmla: flash_mla does not import" in msg and "FlashMLA" in msg
    assert "cuda-flashinfer: flashinfer does not import" in msg
    assert "pip install flashinfer-python" in msg


def test_cuda_picks_flashmla_then_flashinfer_where_they_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", types.ModuleType("flash_mla"))
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    assert type(attention_backend(MLA, "cuda")) is MLAFlashMLA
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    assert type(attention_backend(MLA, "cuda")) is MLAFlashInfer


def test_npu_without_torch_npu_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(BackendUnavailable, match=r"npu-mla-fia: torch_npu does not import.*CANN"):
        attention_backend(MLA, "npu")


def test_flashmla_refuses_a_cache_it_cannot_read() -> None:
    b = MLAFlashMLA(select_attention_backend(MLA, "cuda"))
    with pytest.raises(ValueError, match="--block-size 64"):
        b.check_cache(16, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        b.check_cache(64, torch.float32)
    b.check_cache(64, torch.bfloat16)


def test_a_model_without_attention_family_has_no_backend() -> None:
    with pytest.raises(BackendUnavailable, match="cpu-dense: no implementation"):
        attention_backend({}, "cpu")


def _meta() -> AttentionMetadata:
    # seq 0: decode at position 20 (blocks 3, 1); seq 1: prefill of 10 after 5 cached (block 0
    # then 2); seq 2: MTP verification of 3 tokens at 16.. (blocks 4, 5)
    return AttentionMetadata.build(
        [SeqChunk(20, 1, [3, 1], 0), SeqChunk(5, 10, [0, 2], 1), SeqChunk(16, 3, [4, 5], 2)], 16
    )


def test_mla_step_tables_are_exact() -> None:
    meta = _meta()
    step = MLAStep.build(None, meta, 16, 8)
    want_slots = [1 * 16 + 4] + [0 * 16 + p for p in range(5, 15)] + [5 * 16 + 0, 81, 82]
    assert step.slot_mapping.tolist() == want_slots
    assert step.decode_rows is not None and step.decode_rows.tolist() == [0, 11, 12, 13]
    assert step.decode_block_table is not None
    assert step.decode_block_table.dtype == torch.int32
    assert step.decode_block_table.tolist() == [[3, 1], [4, 5]]
    assert step.decode_query_start_loc is not None
    assert step.decode_query_start_loc.tolist() == [0, 1, 4]
    assert step.decode_seq_lens is not None and step.decode_seq_lens.tolist() == [21, 19]
    assert step.decode_seq_lens_list == [21, 19] and step.decode_num_queries == [1, 3]
    assert step.prefill == [PrefillSeq(1, 1, 10, 5)]
    only_prefill = MLAStep.build(None, meta, 16, 0)
    assert only_prefill.decode_rows is None and len(only_prefill.prefill) == 3


def test_a_step_is_planned_once_whatever_the_number_of_layers() -> None:
    meta = _meta()
    b = MLATorch(select_attention_backend(MLA, "cpu"))
    assert b.plan(meta, 16) is b.plan(meta, 16)
    v4 = V4Torch(select_attention_backend(V4, "cpu"))
    assert v4.plan(meta, 16) is v4.plan(meta, 16)


def test_v4_decode_step_indices_are_exact() -> None:
    meta = _meta()
    step = V4Step.build(None, meta, 16)
    assert step.prefill == [1, 2]
    dec = step.decode
    assert isinstance(dec, V4DecodeStep) and dec.seqs == [0]
    # ring of 6 rows per slot, the last 4 positions 17..20 of slot 0
    ring = dec.ring(6, 4)
    assert ring.write.tolist() == [20 % 6]
    assert ring.read.tolist() == [[17 % 6, 18 % 6, 19 % 6, 20 % 6]]
    assert ring.read_valid.all()
    # ratio 4, 4 entries per block: 21 tokens -> 5 entries, entry 4 completes now (pos 20 is
    # not a block end: (20 + 1) % 4 != 0), entries 0-3 in block 3, entry 4 in block 1
    plan = dec.ratio(4)
    assert plan.entries.tolist() == [[12, 13, 14, 15, 4]]
    assert plan.entries_valid.all() and plan.done.numel() == 0
    # ratio 3 would complete entry 6 at position 20: block 16 // 3 = 5 per block -> block 1
    plan3 = dec.ratio(3)
    assert plan3.done.tolist() == [0] and plan3.done_win.tolist() == [6]
    assert plan3.done_entry.tolist() == [1 * 5 + 1]
    early = V4DecodeStep.build(AttentionMetadata.build([SeqChunk(1, 1, [7], 3)], 16), 16)
    assert early is not None
    r = early.ring(8, 4)
    assert r.read_valid.tolist() == [[False, False, True, True]]
    assert r.read.tolist() == [[0, 0, 3 * 8 + 0, 3 * 8 + 1]]
