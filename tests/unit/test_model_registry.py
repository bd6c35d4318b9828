from __future__ import annotations

import logging
import sys
import types

import pytest

from dsv4_serving.models.config import DeepseekV3Config, DeepseekV4Config, architecture_of
from dsv4_serving.models.registry import REGISTRY, ModelRegistry, UnknownArchitectureError
from dsv4_serving.platform.backend import select_attention_backend
from dsv4_serving.platform.device import PlatformError, detect_platform, get_platform


def test_builtin_architectures_are_registered_lazily() -> None:
    reg = REGISTRY.registration("DeepseekV4ForCausalLM")
    assert reg.target == "dsv4_serving.models.deepseek_v4:DeepseekV4ForCausalLM"
    assert reg.source == "builtin"
    assert "DeepseekV3ForCausalLM" in REGISTRY.architectures()


def test_unknown_architecture_lists_what_is_registered() -> None:
    with pytest.raises(UnknownArchitectureError) as exc:
        REGISTRY.registration("LlamaForCausalLM")
    msg = str(exc.value)
    assert "LlamaForCausalLM" in msg and "DeepseekV4ForCausalLM" in msg


def test_later_registration_overrides_and_warns_naming_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = ModelRegistry()
    reg._plugins_loaded = True  # no entry points in this test
    reg.register("X", "a.mod:First", "builtin")
    mod = types.ModuleType("fake_plugin_mod")
    mod.Second = type("Second", (), {})  # type: ignore[attr-defined]
    sys.modules["fake_plugin_mod"] = mod
    with caplog.at_level(logging.WARNING):
        reg.register("X", "fake_plugin_mod:Second", "entry point plugin:X")
    assert "a.mod:First" in caplog.text and "fake_plugin_mod:Second" in caplog.text
    assert reg.resolve("X") is mod.Second  # type: ignore[attr-defined]


def test_entry_point_plugins_register(monkeypatch: pytest.MonkeyPatch) -> None:
    class EP:
        name = "PluginArch"
        dist = types.SimpleNamespace(name="plugin-dist")

        def load(self):  # type: ignore[no-untyped-def]
            return "plugin_pkg.models:PluginModel"

    import dsv4_serving.models.registry as registry_mod

    monkeypatch.setattr(registry_mod, "entry_points", lambda group: [EP()])
    reg = ModelRegistry()
    assert reg.registration("PluginArch").source == "entry point plugin-dist:PluginArch"


def test_unimportable_target_is_a_clear_error() -> None:
    reg = ModelRegistry()
    reg._plugins_loaded = True
    reg.register("Y", "no_such_module_xyz:Model")
    with pytest.raises(ImportError, match="no_such_module_xyz:Model"):
        reg.resolve("Y")


def test_missing_architectures_field_is_an_error() -> None:
    with pytest.raises(ValueError, match="architectures"):
        architecture_of({"model_type": "deepseek_v4"})


def test_backend_choice_follows_config_fields() -> None:
    v4 = select_attention_backend({"compress_ratios": [0, 4, 128], "index_topk": 512}, "npu")
    assert v4.name == "npu-v4-sparse-compressed"
    assert v4.switches["enable_sparse_sfa_c8"] is True and v4.switches["enable_mlapo"] is False
    assert "compress_ratios" in v4.reason
    mla = select_attention_backend({"kv_lora_rank": 512}, "npu")
    assert mla.name == "npu-mla" and mla.switches["enable_mlapo"] is True
    assert select_attention_backend({"kv_lora_rank": 512}, "cpu").switches["enable_mlapo"] is False
    assert select_attention_backend({}, "cpu").name == "cpu-dense"


def test_platform_cpu_always_and_missing_devices_fail_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    import dsv4_serving.platform.device as dev

    assert get_platform("cpu").dist_backend == "gloo"
    monkeypatch.setattr(dev, "_torch_npu_present", lambda: False)
    with pytest.raises(PlatformError, match="torch_npu is not installed"):
        get_platform("npu")
    monkeypatch.setattr(dev, "_cuda_available", lambda: False)
    with pytest.raises(PlatformError, match="no CUDA device"):
        get_platform("cuda")
    with pytest.raises(PlatformError, match="unknown device"):
        get_platform("tpu")
    auto = detect_platform("auto")
    assert auto.name == "cpu" and "no torch_npu" in auto.reason


def test_v4_config_accepts_native_and_transformers_spellings() -> None:
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "head_dim": 16,
        "q_lora_rank": 4,
        "moe_intermediate_size": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "o_groups": 1,
        "index_head_dim": 8,
        "qk_rope_head_dim": 4,
    }
    native = DeepseekV4Config.from_dict(
        {**base, "compress_ratios": [0, 4, 128], "compress_rate_hca": 16, "num_hash_layers": 2}
    )
    hf = DeepseekV4Config.from_dict(
        {
            **base,
            "layer_types": [
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            "compress_rates": {
                "compressed_sparse_attention": 4,
                "heavily_compressed_attention": 16,
            },
            "mlp_layer_types": ["hash_moe", "hash_moe", "moe"],
        }
    )
    assert native.compress_ratios == hf.compress_ratios == (0, 4, 16)
    assert native.num_hash_layers == hf.num_hash_layers == 2
    assert native.is_csa(1) and not native.is_csa(2) and native.layer_ratio(3) == 0
    with pytest.raises(ValueError, match="compress ratio 8"):
        DeepseekV4Config.from_dict({**base, "compress_ratios": [0, 8, 128]})


def test_v3_yarn_softmax_scale_uses_mscale_all_dim() -> None:
    cfg = DeepseekV3Config.from_dict(
        {
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "moe_intermediate_size": 4,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
            },
        }
    )
    m = 0.1 * __import__("math").log(40) + 1.0
    assert cfg.softmax_scale() == pytest.approx(32**-0.5 * m * m)
    assert cfg.rope.attention_factor == pytest.approx(1.0)
