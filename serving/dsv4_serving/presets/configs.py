"""Preset model configs, in the form a checkpoint's ``config.json`` takes (native V4 keys)."""

# DeepSeek's special tokens are spelled with fullwidth bars and U+2581 on purpose.
# ruff: noqa: RUF001

from __future__ import annotations

import copy
from typing import Any

# ids 256.. after the 256 byte tokens, in the real V4 tokenizer's order (bos 256, eos 257);
# which of them decoding skips: presets/tokenizer.py
SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
)
VOCAB = 256 + len(SPECIAL_TOKENS)

PRESETS: dict[str, dict[str, Any]] = {
    # Fast on CPU, yet every V4 mechanism is exercised within a 256-token prompt: the real
    # 128-token window, CSA (ratio 4, top-16 of up to 64 entries) and HCA (ratio shrunk to 16,
    # so 16 blocks), a hash-routed and bias-routed MoE layers, mHC with 4 streams, one MTP layer.
    "dsv4-tiny": {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 64,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "compress_ratios": [0, 4, 128, 4, 0],
        "compress_rate_csa": 4,
        "compress_rate_hca": 16,
        "num_hash_layers": 1,
        "index_n_heads": 8,
        "index_head_dim": 64,
        "index_topk": 16,
        "sliding_window": 128,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
    # MLA dims vLLM's CPU backend accepts (kv_lora_rank 512 + qk_rope_head_dim 64 = 576), so
    # the same config runs on vLLM for comparison.
    "dsv3-small": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
}


# dsv4-tiny for long prompts: V4's real ratios (CSA 4, HCA 128) and 128K positions (YaRN 32 x
# 4096), so CPU tests and benchmarks can prefill 32K-128K-token prompts through every mechanism.
PRESETS["dsv4-tiny-long"] = {
    **copy.deepcopy(PRESETS["dsv4-tiny"]),
    "compress_rate_hca": 128,
    "rope_scaling": {
        "type": "yarn",
        "factor": 32,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 131072,
}


# Config-only shapes (config.json fields; no weights or tokenizer, not servable presets): the
# released models, for which ``dsv4 explain-model`` plans memory, and the benchmarks' anchor.
_V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]  # 43 layers, then the MTP layer
SHAPES: dict[str, dict[str, Any]] = {
    "deepseek-v4-flash": {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "hidden_size": 4096,
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "compress_ratios": _V4_FLASH_RATIOS,
        "num_hash_layers": 3,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "sliding_window": 128,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 163840,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    },
    # The engine comparison's model (benchmarks/engine_vs_vllm.py, benchmarks/quantized.py):
    # a small V3 with MLA dims vLLM's CPU backend accepts and twice dsv3-small's width.
    "dsv3-anchor": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 1024,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "q_lora_rank": 256,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": 0,
    },
}


def preset_config(name: str) -> dict[str, Any]:
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None


def shape_config(name: str) -> dict[str, Any]:
    try:
        return copy.deepcopy(SHAPES[name])
    except KeyError:
        raise KeyError(f"unknown shape {name!r}; shapes: {', '.join(sorted(SHAPES))}") from None
