from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4_common.cli import main
from dsv4_serving.presets import write_preset


def test_explain_model_follows_the_seed_troubleshooting_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explain-model", "dsv4-tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    order = [
        "DeepseekV4ForCausalLM -> dsv4_serving.models.deepseek_v4:DeepseekV4ForCausalLM",
        "registered by builtin",
        "device: cpu",
        "attention backend: cpu-v4-sparse-compressed",
        "because: config has compress_ratios",
        "implementations (the engine runs the first that can run here): v4-torch",
        "enable_sparse_sfa_c8 = false",
        "enable_mlapo = false",
        "window, CSA/4, HCA/16, CSA/4",
    ]
    positions = [out.index(s) for s in order]
    assert positions == sorted(positions)


def test_explain_model_reads_a_checkpoint_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_preset("dsv3-small", tmp_path)
    assert main(["explain-model", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "cpu-mla" in out and "kv_lora_rank=512" in out and "1 dense, 3 MoE" in out
    assert "first that can run here): cpu-mla-paged, cpu-mla-torch" in out


def test_unknown_architecture_is_step_one_and_lists_registered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert main(["explain-model", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "1. architecture" in err and "GPT2LMHeadModel" in err
    assert "DeepseekV4ForCausalLM" in err and "DeepseekV3ForCausalLM" in err


def test_missing_device_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    assert main(["explain-model", "dsv4-tiny", "--device", "npu"]) == 1
    assert "torch_npu is not installed" in capsys.readouterr().err


def test_explain_model_cp_prints_the_plan_and_bytes_per_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explain-model", "deepseek-v4-flash", "--cp", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    order = [
        "5b. context parallel (--cp 2)",
        "all-gathered: the shared K=V rows",
        "131072-token prompt as one chunk: work imbalance 1.0002",
        "KV 871.3 MiB per rank (replicated)",
        "rank 0: 65536 rows (positions 0-32767, 98304-131071), 50.0% of the key visits; "
        "residual 2.00 GiB, indexer scores 512.00 GiB in one pass (<= 256.0 MiB per slice); "
        "receives 11.75 GiB over 43 layers",
        "rank 1: 65536 rows (positions 32768-65535, 65536-98303)",
        "1048576-token prompt as one chunk",
        "receives 94.00 GiB over 43 layers",
        "rank 1: 524288 rows (positions 262144-524287, 524288-786431)",
        "6. memory plan per rank",
    ]
    positions = [out.index(s) for s in order]
    assert positions == sorted(positions)
    assert main(["explain-model", "deepseek-v4-flash", "--device", "cpu"]) == 0
    assert "context parallel" not in capsys.readouterr().out
    assert main(["explain-model", "dsv3-small", "--cp", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "all-gathered: the latent rows (kv_lora_rank + rope)" in out
    assert "(beyond max_position_embeddings 4096)" in out
    assert main(["explain-model", "dsv4-tiny", "--cp", "0"]) == 1
    assert "--cp must be >= 1, got 0" in capsys.readouterr().err
