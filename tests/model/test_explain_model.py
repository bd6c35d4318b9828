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
