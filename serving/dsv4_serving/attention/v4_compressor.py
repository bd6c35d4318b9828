"""DeepSeek V4's compressors and lightning indexer: the modules that pool a layer's tokens into
compressed entries (HCA: blocks of ``m'`` tokens; CSA: overlapping ``2m``-token spans) and score
the entries each query keeps (the indexer's top-k). Replicated on every TP rank.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4_serving.kernels.v4_attn import V4_ATTN
from dsv4_serving.layers.linear import ReplicatedLinear
from dsv4_serving.layers.norm import RMSNorm
from dsv4_serving.layers.quant.methods import QuantMethod
from dsv4_serving.layers.rope import Rotary, rotate_tail_interleaved
from dsv4_serving.models.config import DeepseekV4Config


def rotate_tail(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """``rotate_tail_interleaved``, in one pass of the kernel on CPU float32 (the torch chain
    is ~8 ops, and slow where the rows broadcast over heads)."""
    ext = V4_ATTN.get(x)
    if ext is None or cos.dtype != torch.float32:
        return rotate_tail_interleaved(x, cos, sin, inverse)
    out: torch.Tensor = ext.rope_tail(x.contiguous(), cos.contiguous(), sin.contiguous(), inverse)
    return out


class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens (two overlapping series when ``overlap``)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        coff = 2 if overlap else 1
        # DeepSeek ships the compressor (and the indexer's weights_proj) unquantized
        self.wkv = ReplicatedLinear(dim, coff * head_dim)
        self.wgate = ReplicatedLinear(dim, coff * head_dim)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim))
        self.norm = RMSNorm(head_dim, eps)
        self.ratio, self.overlap, self.head_dim = ratio, overlap, head_dim

    @property
    def state_len(self) -> int:
        return (2 if self.overlap else 1) * self.ratio

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Raw per-token state ``[kv | gate]``, what the cache keeps for unfinished blocks."""
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def pool(
        self, proj: torch.Tensor, base: int, first_w: int, n_win: int, rotary: Rotary
    ) -> torch.Tensor:
        """Entries ``first_w .. first_w + n_win - 1`` from ``proj`` rows at positions
        ``base ..`` -> ``[n_win, head_dim]``, normed and rotated at their block start."""
        r = self.ratio
        wins = torch.arange(first_w, first_w + n_win, device=proj.device)
        offs = torch.arange(r, device=proj.device)
        cur = wins[:, None] * r - base + offs[None, :]  # [n_win, r] rows of the block itself
        prev = proj[(cur - r).clamp(min=0)] if self.overlap else None
        return self.pool_rows(proj[cur], prev, wins, rotary)

    def pool_rows(
        self, cur: torch.Tensor, prev: torch.Tensor | None, wins: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """Entries ``wins`` from the raw rows of their own block ``cur`` ``[N, r, 2 * width]``
        and (overlap) of the block before ``prev`` (ignored for entry 0) -> ``[N, head_dim]``."""
        r, d = self.ratio, self.head_dim
        width = cur.shape[-1] // 2
        kv, gate = cur[..., :width], cur[..., width:]
        ape = self.ape.float()
        if prev is None:
            k = kv.float()
            g = gate.float() + ape
        else:
            k_cur = kv[..., d:].float()
            g_cur = gate[..., d:].float() + ape[:, d:]
            has_prev = (wins >= 1)[:, None, None]
            k_prev = torch.where(has_prev, prev[..., :d].float(), 0.0)
            g_prev = torch.where(
                has_prev, prev[..., width : width + d].float() + ape[:, :d], -torch.inf
            )
            k = torch.cat((k_prev, k_cur), dim=1)
            g = torch.cat((g_prev, g_cur), dim=1)
        pooled = (k * g.softmax(dim=1)).sum(dim=1).to(cur.dtype)
        pooled = self.norm(pooled)
        cos, sin = rotary.cos_sin(wins * r)
        return rotate_tail(pooled, cos, sin)


class Indexer(nn.Module):
    """Lightning indexer: ``score(t, w) = sum_h relu(q_th . k_w) * scale * weight_th``."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int, quant: QuantMethod | None = None) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.wq_b = ReplicatedLinear(
            cfg.q_lora_rank, self.n_heads * self.head_dim, quant or QuantMethod()
        )
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, True, cfg.rms_norm_eps)
