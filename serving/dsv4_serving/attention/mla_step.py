"""Per-step metadata of MLA attention over the paged latent cache, built once per step (every
layer of the step reads it; none rebuilds it).

From an ``AttentionMetadata`` and the cache's block size:
  - ``slot_mapping``: the flat row (``block * block_size + offset``) of every new token in a
    ``[num_blocks * block_size, width]`` view of a layer's pool, where its latent is written;
  - the decode split: sequences with at most ``max_decode_queries`` new tokens (decode, MTP
    verification, short chunks) with their query rows, an int32 block table, int32 query
    offsets and int32 key lengths (what the paged kernels take, vLLM's ``block_table`` /
    ``query_start_loc`` / ``seq_lens``), and the key lengths as a host list (Ascend's fused
    attention takes them as one);
  - the prefill split: every other sequence as (sequence, first row, cached context length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsv4_serving.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    seq: int  # index in the step's batch
    start: int  # first row in the flat batch
    num_new: int
    context_len: int  # tokens of this sequence already in the cache


@dataclass(frozen=True, slots=True)
class MLAStep:
    backend: Any  # the attention backend that planned the step (and runs its attention)
    meta: AttentionMetadata
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64
    # decode split: None where no sequence of the step qualifies
    decode_rows: torch.Tensor | None  # [Td] int64 rows of the flat batch
    decode_block_table: torch.Tensor | None  # [Sd, max_blocks] int32
    decode_query_start_loc: torch.Tensor | None  # [Sd + 1] int32
    decode_seq_lens: torch.Tensor | None  # [Sd] int32 (keys, the new tokens included)
    decode_seq_lens_list: list[int]
    decode_query_start_loc_list: list[int]
    decode_num_queries: list[int]  # new tokens per decode sequence
    prefill: list[PrefillSeq]

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.decode_num_queries)

    @classmethod
    def build(
        cls, backend: Any, meta: AttentionMetadata, block_size: int, max_decode_queries: int
    ) -> MLAStep:
        dev = meta.positions.device
        qsl = meta.query_start_loc
        n_new = [qsl[i + 1] - qsl[i] for i in range(meta.num_seqs)]
        seq_of = torch.repeat_interleave(
            torch.arange(meta.num_seqs, device=dev), torch.tensor(n_new, device=dev)
        )
        pos = meta.positions
        slots = meta.block_tables[seq_of, pos // block_size] * block_size + pos % block_size
        dec = [i for i in range(meta.num_seqs) if n_new[i] <= max_decode_queries]
        prefill = [
            PrefillSeq(i, qsl[i], n_new[i], meta.context_lens[i])
            for i in range(meta.num_seqs)
            if n_new[i] > max_decode_queries
        ]
        if not dec:
            return cls(
                backend, meta, block_size, slots, None, None, None, None, [], [0], [], prefill
            )
        rows = [r for i in dec for r in range(qsl[i], qsl[i + 1])]
        sub = [0]
        for i in dec:
            sub.append(sub[-1] + n_new[i])
        lens = [meta.context_lens[i] + n_new[i] for i in dec]
        width = max(1, -(-max(lens) // block_size))
        table = meta.block_tables[torch.tensor(dec, device=dev), :width]
        return cls(
            backend,
            meta,
            block_size,
            slots,
            torch.tensor(rows, dtype=torch.long, device=dev),
            table.to(torch.int32).contiguous(),
            torch.tensor(sub, dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev),
            lens,
            sub,
            [n_new[i] for i in dec],
            prefill,
        )
