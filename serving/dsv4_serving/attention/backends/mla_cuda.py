"""MLA decode on CUDA through FlashMLA or FlashInfer, over the same one-tensor latent layout as
the CPU (``[num_blocks, block_size, kv_lora_rank + rope]``). Prefill chunks and the cache
write stay the torch ones (``attention/backends/mla_torch.py``: SDPA dispatches to flash
attention on CUDA). Selected only where the library imports (``attention/selector.py``); not
run on this project's CPU machines, where the selection and its failure message are what is
tested.
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4_serving.attention.backends.base import library_missing
from dsv4_serving.attention.backends.mla_torch import MLATorch
from dsv4_serving.attention.mla_step import MLAStep


def _uniform_queries(step: MLAStep) -> int | None:
    """The one query count every decode sequence has, or None (FlashMLA's q is [B, s_q, h, D])."""
    n = set(step.decode_num_queries)
    return n.pop() if len(n) == 1 else None


class MLAFlashMLA(MLATorch):
    """DeepSeek's FlashMLA: ``flash_mla_with_kvcache`` over block-64 bf16/fp16 latents, its
    tile-scheduler metadata computed once per step."""

    name = "cuda-flashmla"
    BLOCK = 64

    @classmethod
    def unavailable(cls) -> str | None:
        return library_missing("flash_mla", "install FlashMLA (github.com/deepseek-ai/FlashMLA)")

    def check_cache(self, block_size: int, dtype: torch.dtype) -> None:
        if block_size != self.BLOCK:
            raise ValueError(
                f"{self.name} reads pages of {self.BLOCK} tokens; start the engine with "
                f"--block-size {self.BLOCK} (got {block_size})"
            )
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{self.name} needs a bf16 or fp16 cache (got {dtype})")

    def decode(
        self, step: MLAStep, q_lat: torch.Tensor, pool: Any, scale: float, dv: int
    ) -> torch.Tensor:
        s_q = _uniform_queries(step)
        if s_q is None:  # mixed query counts (MTP beside short chunks): the torch path
            return super().decode(step, q_lat, pool, scale, dv)
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata

        # the tile schedule depends on the step alone: the first layer makes it, all reuse it
        md: Any = step.meta.memo.get("flashmla")
        if md is None:
            md = step.meta.memo["flashmla"] = get_mla_metadata(
                step.decode_seq_lens, s_q * q_lat.shape[1], 1
            )
        tile_md, num_splits = md
        b = len(step.decode_num_queries)
        q = q_lat.to(pool.dtype).view(b, s_q, q_lat.shape[1], q_lat.shape[2])
        out, _ = flash_mla_with_kvcache(
            q,
            pool.unsqueeze(2),  # [N, 64, 1, D]: one latent "head"
            step.decode_block_table,
            step.decode_seq_lens,
            dv,
            tile_md,
            num_splits,
            softmax_scale=scale,
            causal=True,
        )
        result: torch.Tensor = out.reshape(b * s_q, q_lat.shape[1], dv).float()
        return result


class MLAFlashInfer(MLATorch):
    """FlashInfer's ``BatchMLAPagedAttentionWrapper``: planned once per step (``plan``), run per
    layer over the latent and rope halves of the pool (strided views, no copy)."""

    name = "cuda-flashinfer"

    @classmethod
    def unavailable(cls) -> str | None:
        return library_missing("flashinfer", "pip install flashinfer-python")

    def check_cache(self, block_size: int, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{self.name} needs a bf16 or fp16 cache (got {dtype})")

    def _wrapper(self, device: torch.device) -> Any:
        w = getattr(self, "_fi", None)
        if w is None:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
            w = self._fi = BatchMLAPagedAttentionWrapper(workspace)
        return w

    def _plan(self, step: MLAStep, q: torch.Tensor, dv: int, scale: float) -> None:
        """FlashInfer's plan for this step, made by the step's first layer."""
        assert step.decode_block_table is not None and step.decode_query_start_loc is not None
        assert step.decode_seq_lens is not None
        bs = step.block_size
        dev = q.device
        pages = [-(-n // bs) for n in step.decode_seq_lens_list]
        indptr = [0]
        for p in pages:
            indptr.append(indptr[-1] + p)
        kv_indices = torch.cat([step.decode_block_table[i, :p] for i, p in enumerate(pages)])
        self._wrapper(dev).plan(
            step.decode_query_start_loc,
            torch.tensor(indptr, dtype=torch.int32, device=dev),
            kv_indices.to(torch.int32),
            step.decode_seq_lens,
            q.shape[1],
            dv,
            q.shape[2] - dv,
            bs,
            True,
            scale,
            q.dtype,
            q.dtype,
        )
        step.meta.memo["flashinfer"] = True

    def decode(
        self, step: MLAStep, q_lat: torch.Tensor, pool: Any, scale: float, dv: int
    ) -> torch.Tensor:
        q = q_lat.to(pool.dtype)
        if "flashinfer" not in step.meta.memo:
            self._plan(step, q, dv, scale)
        out = self._wrapper(q.device).run(
            q[..., :dv].contiguous(), q[..., dv:].contiguous(), pool[..., :dv], pool[..., dv:]
        )
        return torch.as_tensor(out).float()
