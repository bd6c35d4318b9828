"""MLA attention in torch over the paged latent cache: the reference every other implementation
is checked against (any torch device), and the CPU fast path (the C++ kernel for decode).

Layout: one ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` tensor per layer
(``attention/kv_cache/mla.py``). Decode (sequences with at most ``max_decode_queries`` new
tokens: decode, MTP verification, short chunks) runs in the absorbed form over the latents
(``kernels/paged_mla.py``'s contract); longer prefill chunks go through ``prefill`` (the MHA form with SDPA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from dsv4_serving.attention.backends.base import AttentionBackend
from dsv4_serving.attention.kv_cache.mla import MLAKVCache
from dsv4_serving.attention.kv_cache.paged import gather_entries
from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.attention.mla_step import MLAStep, PrefillSeq
from dsv4_serving.kernels.build import KernelUnavailable, build
from dsv4_serving.kernels.paged_mla import paged_mla_attention

if TYPE_CHECKING:
    from dsv4_serving.attention.mla import MLAttention


class MLATorch(AttentionBackend[MLAStep]):
    """Pure torch: decode through the chunked gather (``kernels/paged_mla.py:chunked``)."""

    name = "cpu-mla-torch"
    max_decode_queries = 8
    """Sequences with up to this many new tokens take ``decode`` (the paged, absorbed form:
    reads each cached latent once); longer chunks take ``prefill`` (MHA over expanded keys and values)."""
    use_kernel = False
    cache_class: ClassVar[type[Any]] = MLAKVCache

    def build_step(self, meta: AttentionMetadata, block_size: int) -> MLAStep:
        return MLAStep.build(self, meta, block_size, self.max_decode_queries)

    # ---- attention -------------------------------------------------------------------------
    def write(self, step: MLAStep, pool: Any, latent: torch.Tensor) -> None:
        """Store every new token's latent row: one scatter into the flattened pool."""
        flat = pool.view(-1, pool.shape[-1])
        flat[step.slot_mapping] = latent.to(flat.dtype)

    def latents(self, pool: Any, block_row: torch.Tensor, n: int) -> torch.Tensor:
        """Rows ``0 .. n-1`` of one sequence's latents ``[n, D]``."""
        return gather_entries(pool, block_row, n)

    def decode(
        self, step: MLAStep, q_lat: torch.Tensor, pool: Any, scale: float, dv: int
    ) -> torch.Tensor:
        """Absorbed queries ``[Td, h, D]`` of the decode rows -> ``[Td, h, dv]`` float32."""
        assert step.decode_block_table is not None
        assert step.decode_query_start_loc is not None and step.decode_seq_lens is not None
        return paged_mla_attention(
            q_lat.float().contiguous(),
            pool,
            step.decode_block_table,
            step.decode_query_start_loc,
            step.decode_seq_lens,
            scale,
            dv,
            use_kernel=self.use_kernel,
        )

    def prefill(
        self,
        layer: MLAttention,
        step: MLAStep,
        seq: PrefillSeq,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        pool: Any,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One prefill chunk -> ``[n, h, v_head_dim]`` float32, in the MHA form (vLLM's MLA
        prefill): the chunk's and its cached context's latents expanded through ``wkv_b`` into
        per-head keys and values, then causal SDPA. For a chunk attending to about as many keys
        as it has queries this is about a quarter of the absorbed form's FLOPs (head dim
        nope + rope and v against kv_lora + rope twice). ``rows``: the chunk offsets
        (ascending) of the queries given, a context-parallel rank's share; ``latent`` is still
        the whole chunk's, and each query sees exactly the keys up to its own position."""
        ctx, n = seq.context_len, seq.num_new
        lat = latent.float()
        if rows is not None:  # keys past the last query are masked for every query: not read
            lat = lat[: int(rows[-1]) + 1]
        if ctx:
            prefix = self.latents(pool, step.meta.block_tables[seq.seq], ctx).float()
            lat = torch.cat((prefix, lat), dim=0)
        keys, h, dv, lora = lat.shape[0], layer.n_heads, layer.v_dim, layer.kv_lora
        k_nope, v = layer.expand(lat[:, :lora])
        rope = lat[:, None, lora:].expand(keys, h, lat.shape[1] - lora)
        k = torch.cat((k_nope, rope), dim=-1)
        q = torch.cat((q_nope.float(), q_pe.float()), dim=-1)
        if v.shape[-1] != q.shape[-1]:
            # the CPU flash kernel wants one head dim for q, k and v (vLLM pads likewise)
            v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
        mask = None
        if ctx or rows is not None:  # causal with an offset (or a row subset): an explicit mask
            kpos = torch.arange(keys, device=lat.device)
            qpos = torch.arange(n, device=lat.device) if rows is None else rows
            mask = kpos[None, :] <= (ctx + qpos)[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=layer.scale,
        )
        return o[0].transpose(0, 1)[..., :dv]


class MLAPagedKernel(MLATorch):
    """CPU fast path: decode through ``kernels/paged_mla.cpp`` (the latents read in place)."""

    name = "cpu-mla-paged"
    use_kernel = True

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            build("paged_mla")
        except KernelUnavailable as exc:
            return f"the paged MLA kernel cannot be built ({exc})"
        return None
