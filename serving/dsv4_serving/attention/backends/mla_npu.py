"""MLA on Ascend NPUs through ``torch_npu``: decode with ``npu_fused_infer_attention_score``
over the split latent layout (``attention/kv_cache/mla.py:MLASplitKVCache``, nope and rope
apart, as the fused kernels read them), vllm-ascend's MLA decode call. Prefill chunks run the
torch path (``attention/backends/mla_torch.py``) over the same cache.

Not written yet: the MLA prolog (``npu_mla_prolog_v2``: projections, norms, rope and cache
write in one kernel, vllm-ascend's MLAPO switch) and the NZ weight format. Selected only where
``torch_npu`` imports; not run on this project's CPU machines.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from dsv4_serving.attention.backends.base import library_missing
from dsv4_serving.attention.backends.mla_torch import MLATorch
from dsv4_serving.attention.kv_cache.mla import MLASplitKVCache
from dsv4_serving.attention.kv_cache.paged import gather_entries
from dsv4_serving.attention.mla_step import MLAStep


class MLAAscend(MLATorch):
    name = "npu-mla-fia"
    max_decode_queries = 16  # FIA's TND layout serves MTP verification as well
    cache_class = MLASplitKVCache

    @classmethod
    def unavailable(cls) -> str | None:
        return library_missing(
            "torch_npu", "install the torch_npu build matching this image's CANN (the npu extra)"
        )

    def write(self, step: MLAStep, pool: Any, latent: torch.Tensor) -> None:
        nope, rope = pool
        d = nope.shape[-1]
        nope.view(-1, d)[step.slot_mapping] = latent[:, :d].to(nope.dtype)
        rope.view(-1, rope.shape[-1])[step.slot_mapping] = latent[:, d:].to(rope.dtype)

    def latents(self, pool: Any, block_row: torch.Tensor, n: int) -> torch.Tensor:
        nope, rope = pool
        return torch.cat(
            (gather_entries(nope, block_row, n), gather_entries(rope, block_row, n)), dim=-1
        ).flatten(1)

    def decode(
        self, step: MLAStep, q_lat: torch.Tensor, pool: Any, scale: float, dv: int
    ) -> torch.Tensor:
        torch_npu = importlib.import_module("torch_npu")
        nope, rope = pool
        h = q_lat.shape[1]
        q = q_lat.to(nope.dtype)
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q[..., :dv],
            nope,
            nope,
            query_rope=q[..., dv:],
            key_rope=rope,
            num_heads=h,
            num_key_value_heads=1,
            input_layout="TND",
            scale=scale,
            antiquant_mode=0,
            antiquant_scale=None,
            block_table=step.decode_block_table,
            block_size=step.block_size,
            # TND takes cumulative query ends and per-sequence key lengths, both host lists
            actual_seq_lengths=[int(x) for x in step.decode_query_start_loc_list[1:]],
            actual_seq_lengths_kv=step.decode_seq_lens_list,
            sparse_mode=3 if max(step.decode_num_queries) > 1 else 0,
        )
        return torch.as_tensor(out).float()
