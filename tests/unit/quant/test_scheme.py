"""The scheme a checkpoint declares, and what --quantization does with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.engine.worker.model_loader import resolve_quantization
from dsv4_serving.layers.quant.scheme import (
    NONE,
    QuantScheme,
    scheme_from_checkpoint,
    scheme_from_config,
)

pytestmark = pytest.mark.unit

V3_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def test_deepseek_releases_and_modelslim_w8a8_are_recognised(tmp_path: Path) -> None:
    assert scheme_from_config({}) == NONE
    assert scheme_from_config({"quantization_config": V3_FP8}) == QuantScheme("fp8", "fp8")
    v4 = {"quantization_config": {**V3_FP8, "scale_fmt": "ue8m0"}, "expert_dtype": "fp4"}
    assert (
        scheme_from_config(v4) == QuantScheme("fp8", "fp4") and scheme_from_config(v4).name == "fp4"
    )
    small = {"quantization_config": {**V3_FP8, "weight_block_size": [32, 64]}}
    assert scheme_from_config(small).block == (32, 64)
    (tmp_path / "quant_model_description.json").write_text(
        json.dumps({"model_quant_type": "W8A8_DYNAMIC", "model.norm.weight": "FLOAT"})
    )
    assert scheme_from_checkpoint({}, tmp_path) == QuantScheme("w8a8", "w8a8")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq' is not supported"),
        ({"quantization_config": {**V3_FP8, "activation_scheme": "static"}}, "dynamic only"),
        ({"quantization_config": {**V3_FP8, "fmt": "e5m2"}}, "only e4m3"),
    ],
)
def test_unsupported_schemes_are_named(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scheme_from_config(config)


def test_static_w8a8_is_refused(tmp_path: Path) -> None:
    (tmp_path / "quant_model_description.json").write_text('{"model_quant_type": "W8A8"}')
    with pytest.raises(ValueError, match="'W8A8' is not supported"):
        scheme_from_checkpoint({}, tmp_path)


def test_quantization_auto_none_match_and_mismatch() -> None:
    fp4 = QuantScheme("fp8", "fp4")
    assert resolve_quantization("auto", fp4, "/ckpt", preset=False) == fp4
    assert resolve_quantization("none", fp4, "/ckpt", preset=False) == NONE
    assert resolve_quantization("fp4", fp4, "/ckpt", preset=False) == fp4
    with pytest.raises(ConfigError, match=r"--quantization w8a8: the checkpoint /ckpt is fp4"):
        resolve_quantization("w8a8", fp4, "/ckpt", preset=False)
    with pytest.raises(ConfigError, match="the checkpoint /ckpt is none"):
        resolve_quantization("fp8", NONE, "/ckpt", preset=False)
    # a preset's dummy weights take any format
    assert resolve_quantization("w8a8", NONE, "dsv3-small", preset=True) == QuantScheme(
        "w8a8", "w8a8"
    )
    with pytest.raises(ConfigError, match="quantization must be auto, none, fp8, fp4 or w8a8"):
        EngineConfig(quantization="int4")  # type: ignore[arg-type]
