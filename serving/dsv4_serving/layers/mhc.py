"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token.

Each block reads one input collapsed from the streams (``pre`` weights) and writes its output
back into every stream (``post`` weights) on top of a doubly-stochastic mix of the old streams
(``comb``, Sinkhorn-normalised), all computed in float32 from the streams themselves.

On the CPU in float32 or bfloat16 the chain after the mixing GEMM runs in the C++ kernel
(``kernels/mhc.cpp``: one call instead of ~130 tiny ops, most of them the Sinkhorn
iterations); the torch code below is the fallback and the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_serving.kernels.mhc import MHC
from dsv4_serving.layers.norm import rms_norm


def _float32(p: torch.Tensor) -> torch.Tensor:
    """A weight as float32: itself, or (bfloat16 models) a copy made once and again only when
    the weight changes; ``fn`` converted at every call was 2 copies of ``(2 + n) n x n D`` per
    layer and step. The copy lives on the weight (it goes with it)."""
    if p.dtype == torch.float32:
        return p
    key = (p.data_ptr(), p._version)
    got: tuple[tuple[int, int], torch.Tensor] | None = getattr(p, "_dsv4_float32", None)
    if got is None or got[0] != key:
        got = (key, p.detach().float().contiguous())
        setattr(p, "_dsv4_float32", got)  # noqa: B010 (a tensor's own attribute, not a field)
    return got[1]


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams`` [T, N, D] -> (block input [T, D], post [T, N], comb [T, N, N])."""
    t, n, _ = streams.shape
    flat = rms_norm(streams.reshape(t, -1).float(), None, norm_eps)
    mixes = F.linear(flat, _float32(fn))
    base, scale = _float32(base), _float32(scale)
    ext = MHC.get(streams)
    if ext is not None:
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = ext.hc_pre(
            mixes,
            base.contiguous(),
            scale.contiguous(),
            streams.contiguous(),
            sinkhorn_iters,
            hc_eps,
        )
        return out
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    s = scale
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * s[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def hc_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams: ``post[n] * out + sum_j comb[j, n] * streams[j]``."""
    ext = MHC.get(streams)
    if ext is not None and block_out.dtype == streams.dtype:
        new: torch.Tensor = ext.hc_post(
            block_out.contiguous(), streams.contiguous(), post.contiguous(), comb.contiguous()
        )
        return new
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Final collapse of the streams before the output norm: [T, N, D] -> [T, D]."""
    t = streams.shape[0]
    flat = rms_norm(streams.reshape(t, -1).float(), None, norm_eps)
    mixes = F.linear(flat, _float32(fn))
    pre = torch.sigmoid(mixes * _float32(scale)[0] + _float32(base)) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
