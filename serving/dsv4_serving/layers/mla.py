"""Multi-head latent attention (DeepSeek V2/V3) over a flat batch and a paged latent cache.

Each token stores one latent row ``[kv_norm(c_kv) | rope(k_pe)]``; keys and values of every
head are re-expanded from the latents through ``wkv_b`` when a query attends to them.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4_serving.cache.metadata import AttentionMetadata
from dsv4_serving.cache.paged import gather_entries
from dsv4_serving.distributed.groups import SOLO, Group
from dsv4_serving.kernels.build import available
from dsv4_serving.kernels.paged_mla import paged_mla_attention
from dsv4_serving.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from dsv4_serving.layers.norm import RMSNorm
from dsv4_serving.layers.quant.methods import QuantMethods
from dsv4_serving.layers.rope import Rotary, rotate_halves, rotate_tail_interleaved
from dsv4_serving.models.config import DeepseekV3Config

KERNEL_MAX_QUERIES = 8
"""Sequences with up to this many new tokens (decode, MTP verification) go through the paged
kernel; longer prefill chunks keep the batched products (the kernel is not a GEMM)."""


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

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            return rotate_tail_interleaved(x, cos, sin)
        return rotate_halves(x, cos, sin)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, latent_cache: torch.Tensor
    ) -> torch.Tensor:
        t, h = x.shape[0], self.n_heads
        q = self.wq(x) if self.q_lora is None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(t, h, self.nope + self.rope_dim)
        cos, sin = self.rotary.cos_sin(meta.positions)
        q_nope, q_pe = q[..., : self.nope], self._rope(q[..., self.nope :], cos, sin)
        kv_a = self.wkv_a(x)
        c = self.kv_norm(kv_a[:, : self.kv_lora])
        k_pe = self._rope(kv_a[:, self.kv_lora :], cos, sin)
        latent = torch.cat((c, k_pe), dim=-1)
        # absorbed form (as vLLM's MLA decode): fold wkv_b's key half into the query and its
        # value half after the softmax, so attention runs over the cached latents directly
        # instead of re-expanding every cached token through wkv_b at every step
        w = self.wkv_b.weight.view(h, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w[:, : self.nope].float(), w[:, self.nope :].float()
        # [latent query | rope query] against [latent | rope key]: one product per score
        q_lat = torch.cat((torch.einsum("thd,hdl->thl", q_nope.float(), w_uk), q_pe.float()), -1)
        out = torch.empty(t, h, self.v_dim, dtype=x.dtype, device=x.device)
        # write every new latent first: one scatter into the flattened pool
        bs, width = latent_cache.shape[1], latent_cache.shape[2]
        flat = latent_cache.view(-1, width)
        qsl = meta.query_start_loc
        n_new = [qsl[i + 1] - qsl[i] for i in range(meta.num_seqs)]
        lens = torch.tensor(n_new, device=x.device)
        seq_of = torch.repeat_interleave(torch.arange(meta.num_seqs, device=x.device), lens)
        pos = meta.positions
        slots = meta.block_tables[seq_of, pos // bs] * bs + pos % bs
        flat[slots] = latent.to(flat.dtype)
        if x.device.type == "cpu" and available("paged_mla"):
            # decode and MTP verification read the cache in place (kernels/paged_mla.cpp)
            done = [i for i in range(meta.num_seqs) if n_new[i] <= KERNEL_MAX_QUERIES]
            if done:
                rows, o_lat = self._paged(q_lat, meta, done, latent_cache)
                out[rows] = torch.einsum("thl,hvl->thv", o_lat, w_uv).to(x.dtype)
        else:
            done = [i for i in range(meta.num_seqs) if n_new[i] == 1]
            if done:
                out[meta.query_start_loc_tensor(done)] = self._decode(
                    q_lat, meta, done, latent_cache, bs, w_uv
                ).to(x.dtype)
        handled = set(done)
        for i in range(meta.num_seqs):
            a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            ctx, n = meta.context_lens[i], b - a
            if i in handled:
                continue
            lat = gather_entries(latent_cache, meta.block_tables[i], ctx + n).float()
            s = torch.einsum("nhl,kl->hnk", q_lat[a:b], lat)
            kpos = torch.arange(ctx + n, device=x.device)
            s = s * self.scale
            s = s.masked_fill(kpos[None, None, :] > pos[a:b][None, :, None], -torch.inf)
            p = s.softmax(dim=-1)
            o_lat = torch.einsum("hnk,kl->nhl", p, lat)[..., : self.kv_lora]
            out[a:b] = torch.einsum("nhl,hvl->nhv", o_lat, w_uv).to(x.dtype)
        return self.wo(out.flatten(1))

    def _paged(
        self, q_lat: torch.Tensor, meta: AttentionMetadata, seqs: list[int], pool: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query rows of ``seqs`` and their attention outputs in latent space."""
        qsl = meta.query_start_loc
        rows = [r for i in seqs for r in range(qsl[i], qsl[i + 1])]
        sub_qsl = [0]
        for i in seqs:
            sub_qsl.append(sub_qsl[-1] + qsl[i + 1] - qsl[i])
        dev = q_lat.device
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        o_lat = paged_mla_attention(
            q_lat[rows_t].contiguous(),
            pool,
            meta.block_tables[torch.tensor(seqs, device=dev)].to(torch.int32),
            torch.tensor(sub_qsl, dtype=torch.int32),
            torch.tensor(
                [meta.context_lens[i] + qsl[i + 1] - qsl[i] for i in seqs], dtype=torch.int32
            ),
            self.scale,
            self.kv_lora,
            use_kernel=True,
        )
        return rows_t, o_lat

    def _decode(
        self,
        q_lat: torch.Tensor,
        meta: AttentionMetadata,
        seqs: list[int],
        pool: torch.Tensor,
        bs: int,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """One query per sequence, all sequences at once over their padded latents."""
        dev = q_lat.device
        rows = meta.query_start_loc_tensor(seqs)
        klen = torch.tensor([meta.context_lens[i] + 1 for i in seqs], device=dev)
        nb = -(-int(klen.max()) // bs)
        # whole blocks (contiguous copies); rows past a sequence's length are masked below
        table = meta.block_tables[torch.tensor(seqs, device=dev), :nb]
        lat = torch.index_select(pool, 0, table.reshape(-1)).view(len(seqs), nb * bs, -1).float()
        kpos = torch.arange(nb * bs, device=dev)
        s = torch.bmm(q_lat[rows], lat.transpose(1, 2))
        s = (s * self.scale).masked_fill(kpos[None, None, :] >= klen[:, None, None], -torch.inf)
        o_lat = torch.bmm(s.softmax(dim=-1), lat)[..., : self.kv_lora]
        return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)
