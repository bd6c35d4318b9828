"""Tiny DeepSeek V4 configs and the transformers reference with our weights."""

from __future__ import annotations

from typing import Any

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsv4_serving.models.reference import transformers_reference

ARCH = "DeepseekV4ForCausalLM"


def tiny_v4_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": [ARCH],
        "model_type": "deepseek_v4",
        "vocab_size": 320,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        # window, CSA, HCA, CSA (+ a window-only MTP layer)
        "compress_ratios": [0, 4, 128, 4, 0],
        "compress_rate_hca": 16,
        "num_hash_layers": 1,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 4,
        "sliding_window": 16,
        "hc_mult": 4,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "swiglu_limit": 10.0,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "torch_dtype": "float32",
    }
    d.update(over)
    return d


def build_ours(d: dict[str, Any], seed: int = 0) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(d)).float().eval()
    init_dummy_weights(model, seed)
    return model


def build_reference(d: dict[str, Any], ours: torch.nn.Module) -> Any:
    return transformers_reference(d, ours)


def prefill_meta(lens: list[int], block_size: int = 64) -> AttentionMetadata:
    chunks, next_block = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        chunks.append(SeqChunk(0, n, list(range(next_block, next_block + nb)), i))
        next_block += nb
    return AttentionMetadata.build(chunks, block_size)
