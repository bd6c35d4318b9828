"""Per-step metadata of V4 attention over the hybrid cache, built once per step: the decode
sequences (one new token each) as flat indices into the cache's rings and paged stores, so a
layer serves all of them with a few batched gathers instead of a Python loop per sequence.

Index conventions (every tensor is addressed through a flat 2-D view of its storage):
  - a ring ``[num_slots, ring, width]`` as ``[num_slots * ring, width]``: row ``slot * ring +
    p % ring`` holds position ``p``;
  - a paged store ``[num_blocks, per_block, width]`` as ``[num_blocks * per_block, width]``:
    entry ``e`` of a sequence lives at ``table[e // per_block] * per_block + e % per_block``.
Invalid slots of a padded row (positions before 0, entries past a sequence's count) point at
row 0 and are masked by the matching ``*_valid`` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_serving.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class RatioPlan:
    """One compression ratio's share of a decode step (shared by the layers of that ratio)."""

    entries: torch.Tensor  # [B, E] flat store rows of entries 0 .. E-1 (E: the most any has)
    entries_valid: torch.Tensor  # [B, E] bool: entry e exists (and is visible: e < (p+1)//r)
    done: torch.Tensor  # [Bc] batch rows whose token completes a block (a new entry)
    done_entry: torch.Tensor  # [Bc] flat store row of that new entry
    done_win: torch.Tensor  # [Bc] the new entry's index (its block start is done_win * ratio)

    @property
    def num_entries(self) -> int:
        return int(self.entries.shape[1])


@dataclass(frozen=True, slots=True)
class RingPlan:
    """Rows of a per-sequence ring of one length, for the positions a decode step touches."""

    write: torch.Tensor  # [B] row of the new token
    read: torch.Tensor  # [B, L] rows of positions p - L + 1 .. p (the new token last)
    read_valid: torch.Tensor  # [B, L] bool: position >= 0


@dataclass(slots=True)
class V4DecodeStep:
    meta: AttentionMetadata
    block_size: int
    seqs: list[int]  # batch indices of the sequences with one new token
    rows: torch.Tensor  # [B] their rows in the flat batch
    slots: torch.Tensor  # [B] state slots
    pos: torch.Tensor  # [B] the new token's position
    table: torch.Tensor  # [B, max_blocks] int64 block tables
    pos_list: list[int]
    _rings: dict[tuple[int, int], RingPlan] = field(default_factory=dict)
    _ratios: dict[tuple[int, int], RatioPlan] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.seqs)

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> V4DecodeStep | None:
        qsl = meta.query_start_loc
        seqs = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        if not seqs:
            return None
        dev = meta.positions.device
        idx = torch.tensor(seqs, dtype=torch.long, device=dev)
        rows = torch.tensor([qsl[i] for i in seqs], dtype=torch.long, device=dev)
        return cls(
            meta,
            block_size,
            seqs,
            rows,
            torch.tensor([meta.state_slots[i] for i in seqs], dtype=torch.long, device=dev),
            meta.positions[rows],
            meta.block_tables[idx],
            [meta.context_lens[i] for i in seqs],
        )

    def ring(self, ring_len: int, span: int) -> RingPlan:
        """Rows of a ring of ``ring_len`` rows per slot for the last ``span`` positions."""
        key = (ring_len, span)
        got = self._rings.get(key)
        if got is None:
            back = torch.arange(span - 1, -1, -1, device=self.pos.device)
            p = self.pos[:, None] - back[None, :]  # [B, span], ascending, p itself last
            valid = p >= 0
            base = self.slots[:, None] * ring_len
            got = self._rings[key] = RingPlan(
                self.slots * ring_len + self.pos % ring_len,
                torch.where(valid, base + p % ring_len, 0),
                valid,
            )
        return got

    def ratio(self, ratio: int) -> RatioPlan:
        """Entries of compression ``ratio`` (``block_size // ratio`` per block)."""
        per = self.block_size // ratio
        key = (ratio, per)
        got = self._ratios.get(key)
        if got is None:
            dev = self.pos.device
            total = (self.pos + 1) // ratio  # entries once this token is in
            e_max = max((p + 1) // ratio for p in self.pos_list)
            e = torch.arange(e_max, device=dev)
            valid = e[None, :] < total[:, None]
            flat = self.table[:, e // per] * per + e % per if e_max else self.table[:, :0]
            done = torch.nonzero((self.pos + 1) % ratio == 0).flatten()
            win = total[done] - 1
            done_entry = self.table[done, win // per] * per + win % per
            got = self._ratios[key] = RatioPlan(
                torch.where(valid, flat, 0), valid, done, done_entry, win
            )
        return got


@dataclass(slots=True)
class V4Step:
    """A step's V4 attention plan: the decode batch and the sequences served one at a time."""

    backend: object  # the attention backend that planned it
    meta: AttentionMetadata
    decode: V4DecodeStep | None
    prefill: list[int]  # batch indices of the sequences with more than one new token

    @classmethod
    def build(cls, backend: object, meta: AttentionMetadata, block_size: int) -> V4Step:
        qsl = meta.query_start_loc
        dec = V4DecodeStep.build(meta, block_size)
        rest = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] > 1]
        return cls(backend, meta, dec, rest)
