"""DeepSeek V3 for serving: MLA over a paged latent cache, group-limited sigmoid MoE, dense
first layers, and the MTP layer of the HF-hosted checkpoints. Native parameter names."""

from __future__ import annotations

import torch
from torch import nn

from dsv4_serving.attention.backends.mla_torch import MLATorch
from dsv4_serving.attention.cp import CPShare
from dsv4_serving.attention.kv_cache.mla import MLAKVCache
from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.attention.mla import MLAttention
from dsv4_serving.attention.mla_step import MLAStep
from dsv4_serving.attention.selector import DeviceBackend
from dsv4_serving.distributed.groups import SINGLE, ModelParallel
from dsv4_serving.layers.moe import SwiGLU, V3MoE
from dsv4_serving.layers.norm import RMSNorm
from dsv4_serving.layers.quant.methods import QuantMethods, methods_for
from dsv4_serving.layers.rope import Rotary
from dsv4_serving.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from dsv4_serving.models.config import DeepseekV3Config


class V3Block(nn.Module):
    def __init__(
        self,
        cfg: DeepseekV3Config,
        layer: int,
        rotary: Rotary,
        parallel: ModelParallel = SINGLE,
        quant: QuantMethods | None = None,
    ) -> None:
        super().__init__()
        q = quant or QuantMethods()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLAttention(cfg, rotary, parallel.tp, q)
        self.ffn: nn.Module
        if layer < cfg.first_k_dense_replace:
            self.ffn = SwiGLU(
                cfg.hidden_size, cfg.intermediate_size, group=parallel.tp, quant=q.linear
            )
        else:
            self.ffn = V3MoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.n_routed_experts,
                cfg.num_experts_per_tok,
                cfg.n_group,
                cfg.topk_group,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor,
                cfg.n_shared_experts,
                parallel,
                q,
            )

    def forward(
        self, x: torch.Tensor, step: MLAStep, cache: MLAKVCache, cp: CPShare | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), step, cache.layer(self.layer), cp=cp)
        return x + self.ffn(self.ffn_norm(x))


class V3MTP(V3Block):
    """``block(eh_proj([enorm(embed(next token)); hnorm(h)]))`` then its own norm; embed and
    head are shared with the main model."""

    def __init__(
        self,
        cfg: DeepseekV3Config,
        layer: int,
        rotary: Rotary,
        parallel: ModelParallel = SINGLE,
        quant: QuantMethods | None = None,
    ) -> None:
        super().__init__(cfg, layer, rotary, parallel, quant)
        dim = cfg.hidden_size
        self.enorm = RMSNorm(dim, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(dim, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """``forward`` -> final hidden states (before the norm) ``[T, D]``; ``compute_logits``."""

    config_class = DeepseekV3Config
    cache_class = MLAKVCache

    def __init__(self, cfg: DeepseekV3Config, parallel: ModelParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        rotary = Rotary(cfg.rope)
        self._rotary = rotary
        self.quant = methods_for(cfg.quant)
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel.tp)
        self.layers = nn.ModuleList(
            V3Block(cfg, i, rotary, parallel, self.quant) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, parallel.tp)
        self.mtp = nn.ModuleList(
            V3MTP(cfg, cfg.num_hidden_layers + i, rotary, parallel, self.quant)
            for i in range(cfg.num_nextn_predict_layers)
        )
        self._attn = DeviceBackend(cfg, MLATorch)

    def attention_backend(self, device: torch.device | None = None) -> MLATorch:
        """The platform's MLA backend for the weights' device."""
        return self._attn.get(device or self.embed.weight.device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        self._rotary.inv_freq = self._rotary.inv_freq.to(self.embed.weight.device)
        return out

    def allocate_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_slots: int = 0,
        dtype: torch.dtype | None = None,
        lookahead: int = 0,
    ) -> MLAKVCache:
        w = self.embed.weight
        cache: MLAKVCache = self.attention_backend(w.device).allocate_cache(
            self.config, num_blocks, block_size, num_slots, w.device, dtype or w.dtype, lookahead
        )
        return cache

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: MLAKVCache,
        cp: CPShare | None = None,
    ) -> torch.Tensor:
        """``cp``: context parallel; this rank runs its rows (``CPShare.rows``) of
        ``input_ids`` (every row's) and returns their hidden states."""
        if cp is not None:
            input_ids = input_ids[cp.rows]
        x = self.embed(input_ids)
        step = self.attention_backend(x.device).plan(meta, cache.block_size)
        for block in self.layers:
            x = block(x, step, cache, cp)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden)).float()

    def mtp_forward(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        cache: MLAKVCache,
        depth: int = 0,
        cp: CPShare | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits for position ``p + 2`` from the hidden state at ``p`` and the token at
        ``p + 1``; ``meta`` addresses positions ``p``. Returns (logits, MTP hidden).
        ``cp``: context parallel, as in ``forward`` (this rank's rows in and out)."""
        if cp is not None:
            next_ids, hidden = next_ids[cp.rows], hidden[cp.rows]
        mtp = self.mtp[depth]
        x = mtp.eh_proj(torch.cat((mtp.enorm(self.embed(next_ids)), mtp.hnorm(hidden)), dim=-1))
        out = mtp(x, self.attention_backend(x.device).plan(meta, cache.block_size), cache, cp)
        return self.head(mtp.norm(out)).float(), out
