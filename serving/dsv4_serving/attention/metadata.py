"""Metadata of one forward step over a flat batch of tokens from many sequences.

Sequence ``i`` contributes tokens ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch,
at consecutive positions ``context_lens[i] ...``: a prefill chunk, a decode token, or a run of
draft tokens to verify. ``context_lens[i]`` tokens of that sequence are already in the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch


class SeqChunk(NamedTuple):
    """One sequence's share of a step: where its cache lives and how many tokens it adds."""

    context_len: int  # tokens already in the cache
    num_new: int  # tokens in this step
    block_ids: Sequence[int]  # paged blocks covering positions [0, context_len + num_new)
    state_slot: int  # row of the per-sequence state tensors (window ring, compressor state)
    # (boundary, slot): also write the state as of position boundary - 1 into that slot, for
    # boundaries inside this chunk (prefix caching of per-sequence state)
    snapshots: Sequence[tuple[int, int]] = ()


class _Rotary(Protocol):
    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: list[int]  # B + 1 offsets into the flat batch
    context_lens: list[int]  # B
    positions: torch.Tensor  # [T] int64, on the model's device
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    num_blocks: list[int]  # B, blocks in use per sequence
    state_slots: list[int]  # B
    snapshots: list[Sequence[tuple[int, int]]] | None = None  # B, or None when there are none
    # per-step values every layer shares, built by the first layer that asks (cos/sin per rope
    # table, an attention backend's plan): once per step, not once per layer
    memo: dict[object, object] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def seq_lens(self) -> list[int]:
        """Cache length of each sequence after this step."""
        q = self.query_start_loc
        return [c + q[i + 1] - q[i] for i, c in enumerate(self.context_lens)]

    def cos_sin(self, rotary: _Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary``'s cos/sin at this step's positions, computed once per step."""
        key = ("cos_sin", id(rotary))
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = rotary.cos_sin(self.positions)
        return got  # type: ignore[return-value]

    def last_token_indices(self) -> torch.Tensor:
        """Flat index of each sequence's last token in this step (where its logits come from)."""
        idx = [q - 1 for q in self.query_start_loc[1:]]
        return torch.tensor(idx, dtype=torch.long, device=self.positions.device)

    def query_start_loc_tensor(self, seqs: Sequence[int]) -> torch.Tensor:
        """Flat index of the first token of each of ``seqs``."""
        idx = [self.query_start_loc[i] for i in seqs]
        return torch.tensor(idx, dtype=torch.long, device=self.positions.device)

    @classmethod
    def build(
        cls,
        chunks: Sequence[SeqChunk],
        block_size: int,
        device: torch.device | str = "cpu",
        block_tables: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """``block_tables``: the chunks' padded block table when the caller keeps one
        (``engine/worker/block_table.py``); else it is built from the chunks' lists."""
        if not chunks:
            raise ValueError("a step needs at least one sequence")
        slots = [c.state_slot for c in chunks]
        if len(set(slots)) != len(slots):
            raise ValueError("a state slot appears twice in one step")
        qsl = [0]
        pos: list[int] = []
        any_snapshots = False
        for c in chunks:
            if c.num_new <= 0:
                raise ValueError("every sequence in a step must add at least one token")
            need = -(-(c.context_len + c.num_new) // block_size)
            if len(c.block_ids) < need:
                raise ValueError(
                    f"sequence at slot {c.state_slot} needs {need} blocks of {block_size} tokens "
                    f"for length {c.context_len + c.num_new}, has {len(c.block_ids)}"
                )
            if c.snapshots:
                any_snapshots = True
                for boundary, _ in c.snapshots:
                    if not c.context_len < boundary < c.context_len + c.num_new:
                        raise ValueError(f"snapshot at {boundary} is not inside the chunk")
            qsl.append(qsl[-1] + c.num_new)
            if c.num_new == 1:
                pos.append(c.context_len)  # a decode token: no range object
            else:
                pos.extend(range(c.context_len, c.context_len + c.num_new))
        table = block_tables
        if table is None:
            width = max(1, max(len(c.block_ids) for c in chunks))
            # one tensor from padded host rows (not one small tensor per sequence)
            table = torch.tensor(
                [[*c.block_ids, *([0] * (width - len(c.block_ids)))] for c in chunks],
                dtype=torch.long,
            )
        return cls(
            query_start_loc=qsl,
            context_lens=[c.context_len for c in chunks],
            positions=torch.tensor(pos, dtype=torch.long, device=device),
            block_tables=table.to(device),
            num_blocks=[len(c.block_ids) for c in chunks],
            state_slots=slots,
            snapshots=[c.snapshots for c in chunks] if any_snapshots else None,
        )
