"""V4 sparse compressed attention in torch (any torch device): the hybrid cache
(``attention/kv_cache/v4.py``) and the per-step plan (``attention/v4_step.py``) that lets the
layers serve every decode sequence of a step in one batched pass. The attention math is the layer's
(``attention/v4.py``); fused NPU/CUDA kernels (vllm-ascend's SFA and lightning-indexer
ops) would subclass this and override the layer-facing parts, not written yet.
"""

from __future__ import annotations

from dsv4_serving.attention.backends.base import AttentionBackend
from dsv4_serving.attention.kv_cache.v4 import V4KVCache
from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.attention.v4_step import V4Step


class V4Torch(AttentionBackend[V4Step]):
    name = "v4-torch"
    cache_class = V4KVCache

    def build_step(self, meta: AttentionMetadata, block_size: int) -> V4Step:
        return V4Step.build(self, meta, block_size)
