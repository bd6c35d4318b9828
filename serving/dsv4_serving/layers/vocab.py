"""Vocab-parallel embedding and LM head: each TP rank holds ``vocab / tp`` contiguous rows.

The embedding looks up the ids it holds (zeros elsewhere) and sums over the group, so every
rank gets the exact full row; the head computes its slice of the logits and gathers them on
the last dim ("sharded logits merged"), so every rank sees the whole distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_serving.distributed.comm import all_gather, all_reduce
from dsv4_serving.distributed.groups import SOLO, Group
from dsv4_serving.layers.linear import ColumnParallelLinear
from dsv4_serving.layers.shard import ShardSpec


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, dim: int, group: Group = SOLO) -> None:
        start, length = group.split(vocab)
        super().__init__(length, dim)
        self.shards = {"weight": ShardSpec(0, start, length, vocab)} if group.size > 1 else {}
        self.group, self.start = group, start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class ParallelLMHead(ColumnParallelLinear):
    def __init__(self, dim: int, vocab: int, group: Group = SOLO) -> None:
        super().__init__(dim, vocab, group)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(F.linear(x, self.weight), self.group, dim=-1)
