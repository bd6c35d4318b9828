"""DeepSeek V3's MLA latent cache: one paged row per token and layer.

``latent[block, j]`` holds ``[kv_a_norm(c_kv) (kv_lora_rank) | rope(k_pe) (qk_rope_head_dim)]``
of token ``b * block_size + j``; the per-head keys and values are re-expanded from it through
``kv_b_proj`` at attention time. No per-sequence state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_serving.models.config import DeepseekV3Config


def _per_layer(
    config: DeepseekV3Config, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype
) -> list[torch.Tensor]:
    """One zeroed tensor of ``shape`` per layer: the model's layers, then its MTP layers."""
    n = config.num_hidden_layers + config.num_nextn_predict_layers
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]


@dataclass(slots=True)
class MLAKVCache:
    block_size: int
    latent: list[torch.Tensor]  # per layer (model layers, then MTP layers)

    @classmethod
    def allocate(
        cls,
        config: DeepseekV3Config,
        num_blocks: int,
        block_size: int,
        num_slots: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        lookahead: int = 0,
    ) -> MLAKVCache:
        """``num_slots`` and ``lookahead`` size per-sequence state: this layout has none."""
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return cls(block_size, _per_layer(config, (num_blocks, block_size, width), device, dtype))

    @property
    def has_state(self) -> bool:
        return False

    def layer(self, i: int) -> torch.Tensor:
        """What layer ``i``'s attention reads and writes."""
        return self.latent[i]

    def paged_tensors(self) -> list[torch.Tensor]:
        return list(self.latent)

    def state_tensors(self) -> list[torch.Tensor]:
        return []

    def named_paged_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return [(f"layers.{i}.latent", "latent", t) for i, t in enumerate(self.latent)]

    def named_state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return []

    def copy_slot(self, src: int, dst: int) -> None:
        pass  # no per-sequence state

    @staticmethod
    def bytes_per_slot(config: DeepseekV3Config, itemsize: int, lookahead: int = 0) -> int:
        return 0

    @staticmethod
    def bytes_per_block(config: DeepseekV3Config, block_size: int, itemsize: int) -> int:
        n = config.num_hidden_layers + config.num_nextn_predict_layers
        return n * block_size * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize


@dataclass(slots=True)
class MLASplitKVCache:
    """The same rows as two tensors per layer, ``nope [N, bs, 1, kv_lora_rank]`` and
    ``rope [N, bs, 1, qk_rope_head_dim]``: the layout Ascend's fused MLA kernels read
    (``npu_mla_prolog_v2``, ``npu_fused_infer_attention_score`` with ``query_rope``/``key_rope``)."""

    block_size: int
    nope: list[torch.Tensor]
    rope: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        config: DeepseekV3Config,
        num_blocks: int,
        block_size: int,
        num_slots: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        lookahead: int = 0,
    ) -> MLASplitKVCache:
        return cls(
            block_size,
            _per_layer(config, (num_blocks, block_size, 1, config.kv_lora_rank), device, dtype),
            _per_layer(config, (num_blocks, block_size, 1, config.qk_rope_head_dim), device, dtype),
        )

    @property
    def has_state(self) -> bool:
        return False

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.nope[i], self.rope[i]

    def paged_tensors(self) -> list[torch.Tensor]:
        return [*self.nope, *self.rope]

    def state_tensors(self) -> list[torch.Tensor]:
        return []

    def named_paged_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return [(f"layers.{i}.nope", "nope", t) for i, t in enumerate(self.nope)] + [
            (f"layers.{i}.rope", "rope", t) for i, t in enumerate(self.rope)
        ]

    def named_state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return []

    def copy_slot(self, src: int, dst: int) -> None:
        pass  # no per-sequence state

    bytes_per_slot = MLAKVCache.bytes_per_slot
    bytes_per_block = MLAKVCache.bytes_per_block
