"""``dsv4 explain-model --device-memory``: weight bytes per rank in the stored format (the
same bytes a built model holds), KV per sequence, and the verdict for DeepSeek-V4-Flash on the
example decode layout (TP 4 x DP 2, EP 8, 64 GiB 910B): fits in W8A8, not in bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_common.cli import main
from dsv4_serving.distributed.topology import Topology
from dsv4_serving.layers.quant.methods import cast_model
from dsv4_serving.layers.quant.scheme import QuantScheme
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsv4_serving.models.memory_plan import memory_plan, parse_bytes
from dsv4_serving.presets.configs import preset_config

pytestmark = pytest.mark.model

FLASH_DECODE = ["deepseek-v4-flash", "--tp", "4", "--dp", "2", "--ep", "8", "--device", "cpu"]


def test_sizes_parse_in_both_unit_systems() -> None:
    assert parse_bytes("64GiB") == 64 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512Mi") == 512 * 2**20
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


@pytest.mark.parametrize("fmt", ["none", "fp8", "fp4", "w8a8"])
def test_planned_weight_bytes_are_what_a_built_model_holds(fmt: str) -> None:
    cfg = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))
    cfg = dataclasses.replace(cfg, quant=QuantScheme.of(fmt))  # type: ignore[arg-type]
    mp = memory_plan(DeepseekV4ForCausalLM, cfg, Topology(), 128, parse_bytes("1GiB"))
    model = cast_model(DeepseekV4ForCausalLM(cfg), torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert mp.plan.weight_bytes_per_rank == held
    assert sum(mp.plan.bytes_by_kind.values()) == held
    assert mp.kv_bytes_per_seq[4096] < mp.kv_bytes_per_seq[32768] < mp.kv_bytes_per_seq[131072]


def test_v4_flash_decode_layout_fits_in_w8a8(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["explain-model", *FLASH_DECODE, "--device-memory", "64GiB", "--quantization", "w8a8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for row in ("weights attention", "weights dense", "weights experts", "weights embeddings"):
        assert row in out
    assert "kv per 128K sequence" in out and "128K sequences at once" in out


def test_v4_flash_decode_layout_does_not_fit_in_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["explain-model", *FLASH_DECODE, "--device-memory", "64GiB", "--quantization", "none"]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "does NOT fit" in captured.out
    assert "the weights alone do not fit" in captured.err and "GiB per rank" in captured.err


def test_v3_shapes_plan_without_weights(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["explain-model", "deepseek-v3", "--tp", "8", "--dp", "2", "--ep", "16"]
    assert main([*args, "--device", "cpu", "--device-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "fp8 + bf16 weights" in out and "kv per token: 71424 bytes" in out
