"""The seed's second choice: the attention backend, from config fields, on a platform.

One function decides, so the engine, ``dsv4 explain-model`` and the tests agree: the family
(MLA, V4 sparse compressed, dense), the derived switches, and the implementations that can serve
it on that platform, in order of preference (``attention/selector.py`` builds the first one that
can run here and says why none can otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class AttentionBackendChoice:
    name: str
    # the config fields that decided it, human-readable
    reason: str
    # derived switches (vllm-ascend names where they exist) with their values
    switches: dict[str, bool] = field(default_factory=dict)
    kv_cache_kind: str = ""
    family: str = "dense"  # "mla", "v4" or "dense"
    # implementation names (``attention/selector.py:IMPLEMENTATIONS``), most preferred first
    implementations: tuple[str, ...] = ()


# the implementations of each family per platform, most preferred first
_IMPLEMENTATIONS: dict[tuple[str, str], tuple[str, ...]] = {
    # the C++ kernel reads the paged cache in place; pure torch where it cannot be built
    ("mla", "cpu"): ("cpu-mla-paged", "cpu-mla-torch"),
    ("mla", "cuda"): ("cuda-flashmla", "cuda-flashinfer"),
    ("mla", "npu"): ("npu-mla-fia",),
    # V4's batched torch path is device-generic; fused SFA/indexer kernels are not written yet
    ("v4", "cpu"): ("v4-torch",),
    ("v4", "cuda"): ("v4-torch",),
    ("v4", "npu"): ("v4-torch",),
}


def config_fields(config: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    """A raw ``config.json`` dict as it is, a parsed config dataclass as its fields."""
    if isinstance(config, Mapping):
        return config
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def select_attention_backend(
    config: Mapping[str, Any] | Any, platform: str
) -> AttentionBackendChoice:
    """Pick the attention implementation for a raw ``config.json`` dict (or a parsed config)
    on ``platform``.

    - ``compress_ratios`` / ``layer_types`` / ``index_topk`` -> V4 sparse compressed attention
      (window + CSA with lightning indexer + HCA); hybrid cache.
    - ``kv_lora_rank`` -> MLA over a latent cache.
    """
    config = config_fields(config)
    fused = platform == "npu"
    if any(k in config for k in ("compress_ratios", "index_topk", "compress_rates")) or any(
        t in ("compressed_sparse_attention", "heavily_compressed_attention")
        for t in config.get("layer_types") or []
    ):
        present = [k for k in ("compress_ratios", "layer_types", "index_topk") if k in config]
        has_csa = "index_topk" in config or 4 in (config.get("compress_ratios") or [])
        return AttentionBackendChoice(
            name=f"{platform}-v4-sparse-compressed",
            reason=f"config has {', '.join(present)}: V4 sliding window + CSA/HCA compression",
            switches={
                # SFA C8 block mode follows from the model using sparse (indexer) attention
                "enable_sparse_sfa_c8": fused and has_csa,
                # the fused MLA pre-processing kernels do not apply to V4's shared-KV head
                "enable_mlapo": False,
                "fused_mc2": fused,
            },
            kv_cache_kind="hybrid: window ring + compressed entries per ratio + indexer keys "
            "+ compressor state",
            family="v4",
            implementations=_IMPLEMENTATIONS.get(("v4", platform), ()),
        )
    if config.get("kv_lora_rank"):
        return AttentionBackendChoice(
            name=f"{platform}-mla",
            reason=f"config has kv_lora_rank={config['kv_lora_rank']}: multi-head latent attention",
            switches={
                "enable_sparse_sfa_c8": False,
                # vllm-ascend turns MLAPO on by default for MLA models on NPU
                "enable_mlapo": fused,
                "fused_mc2": fused,
            },
            kv_cache_kind=f"latent: kv_lora_rank {config['kv_lora_rank']} + rope "
            f"{config.get('qk_rope_head_dim', 64)} per token"
            + (", split nope/rope tensors" if platform == "npu" else ""),
            family="mla",
            implementations=_IMPLEMENTATIONS.get(("mla", platform), ()),
        )
    return AttentionBackendChoice(
        name=f"{platform}-dense",
        reason="neither compress_ratios/index_topk nor kv_lora_rank in config: plain attention",
        switches={"enable_sparse_sfa_c8": False, "enable_mlapo": False, "fused_mc2": fused},
        kv_cache_kind="per-token K and V",
    )
