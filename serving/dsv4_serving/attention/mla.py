"""Multi-head latent attention (DeepSeek V2/V3) over a flat batch and a paged latent cache.

Each token stores one latent row ``[kv_norm(c_kv) | rope(k_pe)]``; keys and values of every
head are re-expanded from the latents through ``wkv_b`` when a query attends to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_serving.attention.cp import CPShare
from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.attention.mla_step import MLAStep
from dsv4_serving.distributed.groups import SOLO, Group
from dsv4_serving.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from dsv4_serving.layers.norm import RMSNorm
from dsv4_serving.layers.quant.methods import QuantMethods
from dsv4_serving.layers.rope import Rotary, rotate_halves, rotate_tail_interleaved
from dsv4_serving.models.config import DeepseekV3Config


class MLAttention(nn.Module):
    def __init__(
        self,
        cfg: DeepseekV3Config,
        rotary: Rotary,
        tp: Group = SOLO,
        quant: QuantMethods | None = None,
    ) -> None:
        super().__init__()
        # wkv_b stays in the compute dtype (dequantized at load): the absorbed form below
        # needs the matrix itself, not a product with it
        q = (quant or QuantMethods()).linear
        h, dim = cfg.num_attention_heads, cfg.hidden_size
        self.n_heads = tp.split(h)[1]
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_lora = cfg.kv_lora_rank
        self.q_lora = cfg.q_lora_rank
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.wq = ColumnParallelLinear(dim, h * qk, tp, q)
        else:
            self.wq_a = ReplicatedLinear(dim, cfg.q_lora_rank, q)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, h * qk, tp, q)
        self.wkv_a = ReplicatedLinear(dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, q)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.wkv_b = ColumnParallelLinear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), tp
        )
        self.wo = RowParallelLinear(h * cfg.v_head_dim, dim, tp, quant=q)
        self.scale = cfg.softmax_scale()
        self.rotary = rotary
        self.interleave = cfg.rope_interleave
        self._absorbed: tuple[tuple[int, int, torch.dtype], torch.Tensor, torch.Tensor] | None = (
            None
        )

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            return rotate_tail_interleaved(x, cos, sin)
        return rotate_halves(x, cos, sin)

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``wkv_b`` split per head into its key half ``[h, nope, kv_lora]`` and value half
        ``[h, v, kv_lora]``, contiguous float32: made once, again only when the weight changes."""
        w = self.wkv_b.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if self._absorbed is None or self._absorbed[0] != key:
            per_head = w.detach().view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
            w_uk = per_head[:, : self.nope].float().contiguous()
            w_uv = per_head[:, self.nope :].float().contiguous()
            self._absorbed = (key, w_uk, w_uv)
        return self._absorbed[1], self._absorbed[2]

    def expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents ``[n, kv_lora]`` float32 -> per-head key part ``[n, h, nope]`` and values
        ``[n, h, v]`` in float32 (prefill's MHA form). A float32 weight is used as it is; a
        low-precision one through the float32 halves ``_absorb_weights`` already keeps (no
        conversion of the matrix per chunk and layer, no further copy)."""
        n, h = lat.shape[0], self.n_heads
        w = self.wkv_b.weight
        if w.dtype == torch.float32:
            kv = F.linear(lat, w).view(n, h, self.nope + self.v_dim)
            return kv[..., : self.nope], kv[..., self.nope :]
        w_uk, w_uv = self._absorb_weights()
        k = F.linear(lat, w_uk.view(h * self.nope, self.kv_lora)).view(n, h, self.nope)
        return k, F.linear(lat, w_uv.view(h * self.v_dim, self.kv_lora)).view(n, h, self.v_dim)

    def project(
        self, x: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[T, h, nope]`` and ``[T, h, rope]`` (rotated), and the latent row each new
        token stores ``[T, kv_lora + rope]``: ``[kv_norm(c_kv) | rope(k_pe)]``. ``rows``: the
        step's rows ``x`` holds (context parallel), else every row."""
        t, h = x.shape[0], self.n_heads
        q = self.wq(x) if self.q_lora is None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(t, h, self.nope + self.rope_dim)
        cos, sin = meta.cos_sin(self.rotary)
        if rows is not None:
            cos, sin = cos[rows], sin[rows]
        q_nope, q_pe = q[..., : self.nope], self._rope(q[..., self.nope :], cos, sin)
        kv_a = self.wkv_a(x)
        c = self.kv_norm(kv_a[:, : self.kv_lora])
        k_pe = self._rope(kv_a[:, self.kv_lora :], cos, sin)
        return q_nope, q_pe, torch.cat((c, k_pe), dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        step: MLAStep,
        latent_cache: torch.Tensor,
        cp: CPShare | None = None,
    ) -> torch.Tensor:
        """``step``: this step's plan from the attention backend
        (``attention/backends/mla_torch.py``), built once per step; the backend stores the
        latents and runs the attention. ``cp``: context parallel; ``x`` holds this rank's rows
        (``CPShare.rows``): their latents are all-gathered so every rank writes the whole
        step's latents (a replicated cache), and attention runs for its rows only."""
        backend = step.backend
        q_nope, q_pe, latent = self.project(x, step.meta, None if cp is None else cp.rows)
        if cp is not None:
            (latent,) = cp.gather([latent])
            q_nope, q_pe = cp.scatter(q_nope), cp.scatter(q_pe)
        t, h = latent.shape[0], self.n_heads
        backend.write(step, latent_cache, latent)
        out = torch.empty(t, h, self.v_dim, dtype=x.dtype, device=x.device)
        if step.decode_rows is not None:
            # absorbed form (as vLLM's MLA decode): fold wkv_b's key half into the query and
            # its value half after the softmax, so attention runs over the cached latents
            # directly instead of re-expanding every cached token through wkv_b at every step
            # (decode rows are replicated: every CP rank computes them)
            rows = step.decode_rows
            w_uk, w_uv = self._absorb_weights()
            q_lat = self._absorb(q_nope[rows], q_pe[rows], w_uk)
            o_lat = backend.decode(step, q_lat, latent_cache, self.scale, self.kv_lora)
            out[rows] = torch.einsum("thl,hvl->thv", o_lat, w_uv).to(x.dtype)
        for seq in step.prefill:
            a, b = seq.start, seq.start + seq.num_new
            mine = None if cp is None else cp.chunk_rows(a, b)
            if mine is None:
                o = backend.prefill(
                    self, step, seq, q_nope[a:b], q_pe[a:b], latent[a:b], latent_cache
                )
                out[a:b] = o.to(x.dtype)
            elif mine.numel():  # this rank's queries of a split chunk, the chunk's keys
                q_n, q_p = q_nope[a:b][mine], q_pe[a:b][mine]
                o = backend.prefill(self, step, seq, q_n, q_p, latent[a:b], latent_cache, mine)
                out[a + mine] = o.to(x.dtype)
        if cp is not None:
            out = out[cp.rows]
        return self.wo(out.flatten(1))

    @staticmethod
    def _absorb(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """[latent query | rope query] against [latent | rope key]: one product per score."""
        return torch.cat((torch.einsum("thd,hdl->thl", q_nope.float(), w_uk), q_pe.float()), -1)
