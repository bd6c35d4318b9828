"""DeepSeek V4 for serving: flat token batches, hybrid KV cache, MTP draft layer.

Parameter names follow DeepSeek's own checkpoints (``embed``, ``layers.N.attn.wq_a``,
``layers.N.ffn.experts.w1`` stacked over experts, ``mtp.0.e_proj``, ...); the loader maps
transformers' names onto them.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4_serving.attention.backends.v4_torch import V4Torch
from dsv4_serving.attention.cp import CPShare
from dsv4_serving.attention.kv_cache.v4 import V4KVCache
from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.attention.selector import DeviceBackend
from dsv4_serving.attention.v4 import V4Attention
from dsv4_serving.attention.v4_step import V4Step
from dsv4_serving.distributed.groups import SINGLE, ModelParallel
from dsv4_serving.kernels.v4_attn import V4_ATTN
from dsv4_serving.layers.mhc import hc_head, hc_post, hc_pre
from dsv4_serving.layers.moe import V4MoE
from dsv4_serving.layers.norm import RMSNorm
from dsv4_serving.layers.quant.methods import QuantMethods, methods_for
from dsv4_serving.layers.rope import Rotary
from dsv4_serving.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from dsv4_serving.models.config import DeepseekV4Config


class V4Block(nn.Module):
    def __init__(
        self,
        cfg: DeepseekV4Config,
        layer: int,
        rotary_main: Rotary,
        rotary_comp: Rotary,
        parallel: ModelParallel = SINGLE,
        quant: QuantMethods | None = None,
    ) -> None:
        super().__init__()
        n, dim = cfg.hc_mult, cfg.hidden_size
        mix = (2 + n) * n
        self.cfg = cfg
        self.layer = layer
        self.attn_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.attn = V4Attention(cfg, layer, rotary_main, rotary_comp, parallel.tp, quant)
        self.ffn = V4MoE(
            dim,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.vocab_size,
            layer < cfg.num_hash_layers,
            cfg.scoring_func,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            cfg.n_shared_experts,
            parallel,
            quant,
        )
        self.hc_attn_fn = nn.Parameter(torch.empty(mix, n * dim))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix, n * dim))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        step: V4Step,
        cache: V4KVCache,
        cp: CPShare | None = None,
    ) -> torch.Tensor:
        c = self.cfg
        x, post, comb = hc_pre(
            streams,
            self.hc_attn_fn,
            self.hc_attn_base,
            self.hc_attn_scale,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.rms_norm_eps,
        )
        out = self.attn(self.attn_norm(x), step, cache.layers[self.layer], cp=cp)
        streams = hc_post(out, streams, post, comb)
        x, post, comb = hc_pre(
            streams,
            self.hc_ffn_fn,
            self.hc_ffn_base,
            self.hc_ffn_scale,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.rms_norm_eps,
        )
        return hc_post(self.ffn(self.ffn_norm(x), input_ids), streams, post, comb)


class V4MTP(V4Block):
    """Multi-token prediction: one more block fed ``e_proj(enorm(embed(next token))) +
    h_proj(hnorm(streams))`` with its own stream collapse and norm, sharing embed and head."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        layer: int,
        rotary_main: Rotary,
        rotary_comp: Rotary,
        parallel: ModelParallel = SINGLE,
        quant: QuantMethods | None = None,
    ) -> None:
        super().__init__(cfg, layer, rotary_main, rotary_comp, parallel, quant)
        dim, n = cfg.hidden_size, cfg.hc_mult
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.enorm = RMSNorm(dim, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(dim, cfg.rms_norm_eps)
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * dim))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))


class DeepseekV4ForCausalLM(nn.Module):
    """``forward(input_ids, meta, cache)`` -> hidden streams ``[T, hc_mult, D]``;
    ``compute_logits(streams)`` -> ``[T, vocab]``; ``mtp_forward`` drafts the next token.
    ``parallel``: the process groups this rank's shard is built for (default: one process)."""

    config_class = DeepseekV4Config
    cache_class = V4KVCache

    def __init__(self, cfg: DeepseekV4Config, parallel: ModelParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        dim, n = cfg.hidden_size, cfg.hc_mult
        rotary_main = Rotary(cfg.main_rope)
        rotary_comp = Rotary(cfg.compress_rope)
        self._rotaries = (rotary_main, rotary_comp)
        self.quant = methods_for(cfg.quant)
        self.embed = VocabParallelEmbedding(cfg.vocab_size, dim, parallel.tp)
        self.layers = nn.ModuleList(
            V4Block(cfg, i, rotary_main, rotary_comp, parallel, self.quant)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.head = ParallelLMHead(dim, cfg.vocab_size, parallel.tp)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * dim))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.mtp = nn.ModuleList(
            V4MTP(cfg, cfg.num_hidden_layers + i, rotary_main, rotary_comp, parallel, self.quant)
            for i in range(cfg.num_nextn_predict_layers)
        )
        self._attn = DeviceBackend(cfg, V4Torch)

    def attention_backend(self, device: torch.device | None = None) -> V4Torch:
        """The platform's V4 backend for the weights' device."""
        return self._attn.get(device or self.embed.weight.device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # keep the rope tables on the parameters' device
        out = super()._apply(fn, recurse)
        dev = self.embed.weight.device
        for r in self._rotaries:
            r.inv_freq = r.inv_freq.to(dev)
        return out

    def allocate_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype | None = None,
        lookahead: int = 0,
    ) -> V4KVCache:
        """``lookahead``: the most positions a step may write past what is kept (speculative
        tokens); the per-sequence rings get that much slack."""
        w = self.embed.weight
        cache: V4KVCache = self.attention_backend(w.device).allocate_cache(
            self.config, num_blocks, block_size, num_slots, w.device, dtype or w.dtype, lookahead
        )
        if w.device.type == "cpu":  # build (or load) the attention kernel now, not in a request
            V4_ATTN.get(w)
        return cache

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: V4KVCache,
        cp: CPShare | None = None,
    ) -> torch.Tensor:
        """``cp``: context parallel; this rank runs its rows (``CPShare.rows``) of
        ``input_ids`` (every row's) and returns their streams."""
        if cp is not None:
            input_ids = input_ids[cp.rows]
        x = self.embed(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        step = self.attention_backend(x.device).plan(meta, cache.block_size)
        for block in self.layers:
            streams = block(streams, input_ids, step, cache, cp)
        return streams

    def _logits(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm: RMSNorm,
    ) -> torch.Tensor:
        c = self.config
        x = hc_head(streams, fn, base, scale, c.hc_eps, c.rms_norm_eps)
        return self.head(norm(x)).float()

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self._logits(
            streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm
        )

    def mtp_forward(
        self,
        next_ids: torch.Tensor,
        streams: torch.Tensor,
        meta: AttentionMetadata,
        cache: V4KVCache,
        depth: int = 0,
        cp: CPShare | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step: ``streams`` are the main model's outputs at positions ``p`` and
        ``next_ids`` the tokens at ``p + 1``; ``meta`` addresses positions ``p`` (the MTP layer
        keeps its own cache rows). Returns (draft logits for ``p + 2``, MTP streams).
        ``cp``: context parallel, as in ``forward``: this rank's rows of every row's inputs in,
        their logits and streams out (the MTP block gathers its cache inputs like a layer)."""
        if cp is not None:
            next_ids, streams = next_ids[cp.rows], streams[cp.rows]
        mtp = self.mtp[depth]
        e = mtp.enorm(self.embed(next_ids))
        h = mtp.h_proj(mtp.hnorm(streams))
        x = mtp.e_proj(e).unsqueeze(1) + h
        step = self.attention_backend(x.device).plan(meta, cache.block_size)
        out = mtp(x, next_ids, step, cache, cp)
        logits = self._logits(out, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, mtp.norm)
        return logits, out
