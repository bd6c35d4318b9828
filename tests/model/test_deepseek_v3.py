"""Our DeepSeek V3 (MLA) against transformers' DeepseekV3ForCausalLM (tiny config, same weights)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.models.config import DeepseekV3Config
from dsv4_serving.models.deepseek_v3 import DeepseekV3ForCausalLM
from dsv4_serving.models.reference import transformers_reference

from .v4_common import prefill_meta

pytest.importorskip("transformers")
VOCAB, BLOCK = 300, 16


def tiny_v3_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 48,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 512,
        "num_nextn_predict_layers": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }
    d.update(over)
    return d


def build(d: dict[str, Any], seed: int) -> tuple[DeepseekV3ForCausalLM, Any]:
    ours = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(d)).float().eval()
    init_dummy_weights(ours, seed)
    return ours, transformers_reference(d, ours)


@pytest.mark.parametrize(
    "over",
    [{}, {"q_lora_rank": None, "rope_interleave": False, "rope_scaling": None}],
    ids=["q_lora-yarn-interleaved", "no_q_lora-default_rope-halves"],
)
def test_v3_decode_through_latent_cache_matches_full_forward(over: dict[str, Any]) -> None:
    d = tiny_v3_dict(**over)
    ours, ref = build(d, seed=5)
    length = 72
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = ref(ids).logits
        tol = 1e-4 * float(full.abs().max())
        lo = ours.compute_logits(
            ours(ids.reshape(-1), prefill_meta([length] * 2, BLOCK), ours.allocate_cache(12, BLOCK))
        )
        assert (lo.view(2, length, -1) - full).abs().max() <= tol
        cache = ours.allocate_cache(12, BLOCK)
        blocks = [[1, 3, 5, 7, 9], [0, 2, 4, 6, 8]]
        got = torch.zeros(2, length, VOCAB)
        done = [0, 0]
        while min(done) < length:
            n = [13 if done[0] == 0 else 1, 5 if done[1] == 0 else 1]
            n = [min(k, length - c) for k, c in zip(n, done, strict=True)]
            chunks = [SeqChunk(done[i], n[i], blocks[i], i) for i in range(2) if n[i]]
            meta = AttentionMetadata.build(chunks, BLOCK)
            toks = torch.cat([ids[i, done[i] : done[i] + n[i]] for i in range(2) if n[i]])
            out = ours.compute_logits(ours(toks, meta, cache))
            k = 0
            for i in range(2):
                if n[i]:
                    got[i, done[i] : done[i] + n[i]] = out[k : k + n[i]]
                    k += n[i]
                    done[i] += n[i]
    assert (got - full).abs().max() <= tol
    assert full[0].argmax(-1).unique().numel() > 10
