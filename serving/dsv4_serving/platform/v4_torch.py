"""V4 sparse compressed attention in torch (any torch device): the hybrid cache
(``cache/v4.py``) and the per-step plan (``cache/v4_step.py``) that lets the layers serve every
decode sequence of a step in one batched pass. The attention math is the layer's
(``layers/v4_attention.py``); fused NPU/CUDA kernels (vllm-ascend's SFA and lightning-indexer
ops) would subclass this and override the layer-facing parts, not written yet.
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4_serving.cache.metadata import AttentionMetadata
from dsv4_serving.cache.v4 import V4KVCache
from dsv4_serving.cache.v4_step import V4Step
from dsv4_serving.platform.attention import AttentionBackend


class V4Torch(AttentionBackend):
    name = "v4-torch"

    def allocate_cache(
        self,
        config: Any,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        device: torch.device | str,
        dtype: torch.dtype,
        lookahead: int = 0,
    ) -> V4KVCache:
        return V4KVCache.allocate(
            config, num_blocks, block_size, num_slots, device, dtype, lookahead
        )

    def plan(self, meta: AttentionMetadata, block_size: int) -> V4Step:
        key = ("v4-plan", self.name, block_size)
        got = meta.memo.get(key)
        if got is None:
            got = meta.memo[key] = V4Step.build(self, meta, block_size)
        assert isinstance(got, V4Step)
        return got
