"""DeepSeek V4's hybrid KV cache: what the model reads and writes, per layer.

Per sequence (``state_slot`` rows, fixed size, overwritten in place):
  - ``window[slot, p % W]``: the shared K=V row (head_dim) of token ``p``, for the last
    ``W = sliding_window`` tokens.
  - ``comp_state[slot, p % S]`` (compressed layers): the compressor's raw projections
    ``[kv | gate]`` of token ``p`` for the last ``S`` tokens, ``S = ratio`` for HCA and
    ``2 * ratio`` for CSA (its entries overlap the previous window); with it the unfinished
    block continues exactly where the last step stopped.
  - ``index_state`` (CSA): the same for the lightning indexer's compressor.
Paged by the sequence's block table (grow with the sequence):
  - ``comp[block, j]``: compressed entry ``b * (block_size // ratio) + j`` (head_dim).
  - ``index[block, j]`` (CSA): the indexer's compressed key of that entry (index_head_dim).

A sequence's state rows are valid only for positions below its ``context_len``; the model
never reads beyond, so a slot needs no clearing when the engine hands it to a new sequence.

``lookahead`` lengthens every ring by that many rows: a speculative step writes up to
``lookahead`` positions past what will be accepted, and a ring of exactly ``W`` rows would let
those rejected rows overwrite live ones (row ``p % W`` still holds ``p - W``, which the next
query needs). With the longer ring a rejected row only lands on a position already out of reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_serving.models.config import DeepseekV4Config


@dataclass(slots=True)
class V4LayerCache:
    ratio: int  # 0 = window only
    window: torch.Tensor
    comp: torch.Tensor | None = None
    comp_state: torch.Tensor | None = None
    index: torch.Tensor | None = None
    index_state: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.window, self.comp, self.comp_state, self.index, self.index_state)
            if t is not None
        ]


@dataclass(slots=True)
class V4KVCache:
    block_size: int
    layers: list[V4LayerCache]  # the model's layers, then its MTP layers

    @classmethod
    def allocate(
        cls,
        config: DeepseekV4Config,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        lookahead: int = 0,
    ) -> V4KVCache:
        for r in (config.csa_ratio, config.hca_ratio):
            if block_size % r:
                raise ValueError(f"block_size {block_size} is not a multiple of ratio {r}")
        d, di, w = config.head_dim, config.index_head_dim, config.sliding_window
        la = lookahead
        layers = []
        for layer in range(config.num_hidden_layers + config.num_nextn_predict_layers):
            r = config.layer_ratio(layer)
            lc = V4LayerCache(r, torch.zeros((num_slots, w + la, d), device=device, dtype=dtype))
            if r:
                coff = 2 if r == config.csa_ratio else 1
                lc.comp = torch.zeros((num_blocks, block_size // r, d), device=device, dtype=dtype)
                lc.comp_state = torch.zeros(
                    (num_slots, coff * r + la, 2 * coff * d), device=device, dtype=dtype
                )
                if r == config.csa_ratio:
                    lc.index = torch.zeros(
                        (num_blocks, block_size // r, di), device=device, dtype=dtype
                    )
                    lc.index_state = torch.zeros(
                        (num_slots, 2 * r + la, 4 * di), device=device, dtype=dtype
                    )
            layers.append(lc)
        return cls(block_size, layers)

    @property
    def has_state(self) -> bool:
        return True

    def paged_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id (dim 0): what a block's content is."""
        return [t for lc in self.layers for t in (lc.comp, lc.index) if t is not None]

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by state slot (dim 0): a sequence's fixed-size state."""
        return [
            t
            for lc in self.layers
            for t in (lc.window, lc.comp_state, lc.index_state)
            if t is not None
        ]

    def named_paged_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """``paged_tensors`` as (name, cache group, tensor), for KV export and import."""
        out = []
        for i, lc in enumerate(self.layers):
            if lc.comp is not None:
                out.append((f"layers.{i}.comp", f"comp{lc.ratio}", lc.comp))
            if lc.index is not None:
                out.append((f"layers.{i}.index", "index", lc.index))
        return out

    def named_state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """``state_tensors`` as (name, cache group, tensor), for KV export and import."""
        out = []
        for i, lc in enumerate(self.layers):
            for name, t in (
                ("window", lc.window),
                ("comp_state", lc.comp_state),
                ("index_state", lc.index_state),
            ):
                if t is not None:
                    out.append((f"layers.{i}.{name}", name, t))
        return out

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one sequence's state rows (snapshot for prefix caching, or restore one)."""
        for t in self.state_tensors():
            t[dst].copy_(t[src])

    @staticmethod
    def bytes_per_block(config: DeepseekV4Config, block_size: int, itemsize: int) -> int:
        """Paged bytes one block costs across all layers (for sizing the block pool)."""
        total = 0
        for layer in range(config.num_hidden_layers + config.num_nextn_predict_layers):
            r = config.layer_ratio(layer)
            if r:
                total += (block_size // r) * config.head_dim
                if r == config.csa_ratio:
                    total += (block_size // r) * config.index_head_dim
        return total * itemsize

    @staticmethod
    def bytes_per_slot(config: DeepseekV4Config, itemsize: int, lookahead: int = 0) -> int:
        """Fixed per-sequence bytes across all layers (window ring + compressor states)."""
        total = 0
        la = lookahead
        for layer in range(config.num_hidden_layers + config.num_nextn_predict_layers):
            r = config.layer_ratio(layer)
            total += (config.sliding_window + la) * config.head_dim
            if r:
                coff = 2 if r == config.csa_ratio else 1
                total += (coff * r + la) * 2 * coff * config.head_dim
                if r == config.csa_ratio:
                    total += (2 * r + la) * 4 * config.index_head_dim
        return total * itemsize
