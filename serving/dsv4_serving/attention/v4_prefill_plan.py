"""The index plans of one step's V4 prefill chunks, built once per step and shared by every
layer (each layer's ring length, window and compression ratio picks its plan): which ring rows
a chunk reads and writes, which compressed entries its queries see, and which rows a pooled
entry comes from. ``V4Attention._prefill`` runs all the step's chunks in one padded pass over
these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.attention.v4_step import V4Step


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """The sliding window of a prefill batch for one ring length and window."""

    read: torch.Tensor  # [S, P] flat ring rows of the positions before the chunks (0: padding)
    kpos: torch.Tensor  # [S, P + N] each key column's position
    k_valid: torch.Tensor  # [S, P + N] bool: the column holds a key (not padding)
    write: torch.Tensor  # [R] flat ring rows of the chunks' last positions
    write_src: torch.Tensor  # [R] their rows in the flat batch
    w_len: int

    def hidden(self, part: RowSlice) -> torch.Tensor:
        """``[S, n, P + N]`` bool: key not in the window of the slice's queries (or padding).
        Built per slice: for the whole batch it is O(N^2)."""
        qpos = part.pos[:, :, None]
        kpos = self.kpos[:, None, :]
        return ~(self.k_valid[:, None, :] & (kpos <= qpos) & (kpos > qpos - self.w_len))


@dataclass(frozen=True, slots=True)
class WindowRows:
    """The sliding window of a prefill batch as the kernel reads it: key rows of a source
    ``cat(kv, ring_rows[older])``, the batch's keys then the ring rows before the chunks."""

    older: torch.Tensor  # [O] flat ring rows appended to the source
    kidx: torch.Tensor  # [R, W] per query row, its window's source rows (-1: before 0)


@dataclass(frozen=True, slots=True)
class EntryPlan:
    """One compression ratio's entries as seen by a prefill batch."""

    entries: torch.Tensor  # [S, E] flat store rows of entries 0 .. E-1 (0: padding)
    limit: torch.Tensor  # [S, N] entries complete before each query ((t + 1) // r, capped)

    def visible(self, part: RowSlice) -> torch.Tensor:
        """``[S, n, E]`` bool: entry complete before the slice's query (``e < (t + 1) // r``).
        Built per slice: for the whole batch it is O(N x E)."""
        e = torch.arange(self.entries.shape[1], device=self.entries.device)
        return e[None, None, :] < self.limit.gather(1, part.cols)[:, :, None]


@dataclass(frozen=True, slots=True)
class RowSlice:
    """Columns ``cols`` of the padded batch ``[S, N]``: the query rows one pass of a layer's
    attention computes, so that the O(rows x context) buffers (indexer scores, entry masks,
    the torch path's logits) stay bounded for long prompts. A CP rank's slices hold its own
    columns only, packed per sequence (``PrefillChunks.parts``)."""

    cols: torch.Tensor  # [S, n] each cell's column of the padded batch (padding: any)
    index: torch.Tensor  # [S, n] rows in the flat batch (0: padding)
    pos: torch.Tensor  # [S, n] positions
    sel: torch.Tensor  # valid cells of [S * n]
    rows: torch.Tensor  # [r] their rows in the flat batch
    r: torch.Tensor  # [r] their indices among ``PrefillChunks.rows``
    seq_of_row: torch.Tensor  # [r] each row's sequence


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """What a compressor does for a prefill batch. Rows are addressed in a source tensor
    ``cat(proj, state_rows[old])``: the batch's projections, then the ring rows of the
    positions each chunk's first new block needs from before the chunk."""

    old: torch.Tensor  # [O] flat state rows appended to the source
    cur: torch.Tensor  # [Nw, r] source rows of each new entry's own block
    prev: torch.Tensor  # [Nw, r] source rows of the block before (clamped at 0; overlap)
    wins: torch.Tensor  # [Nw] the new entries' indices
    new_entry: torch.Tensor  # [Nw] their flat store rows
    write: torch.Tensor  # [R] flat state rows of the chunks' last positions
    write_src: torch.Tensor  # [R] their rows in the flat batch
    starts: list[int]  # per sequence: first batch row, context, first old position, offset
    ctx: list[int]
    base: list[int]
    old_off: list[int]
    num_rows: int  # rows of the flat batch (where the old rows start in the source)

    def source(self, s: int, pos: torch.Tensor) -> torch.Tensor:
        """Source rows of positions ``pos`` of sequence ``s``."""
        ctx = self.ctx[s]
        return torch.where(
            pos >= ctx,
            self.starts[s] + pos - ctx,
            self.num_rows + self.old_off[s] + pos - self.base[s],
        )


def prefill_chunks(step: V4Step) -> PrefillChunks:
    """The step's prefill batch, built by its first layer and shared by the others."""
    key = "v4-prefill-chunks"
    got = step.meta.memo.get(key)
    if got is None:
        got = step.meta.memo[key] = PrefillChunks(step.meta, step.prefill)
    assert isinstance(got, PrefillChunks)
    return got


class PrefillChunks:
    """The sequences of a step with more than one new token, as a padded batch ``[S, N]``,
    and the index plans the layers share (built by the first layer that asks, per ring
    length, window and ratio)."""

    def __init__(self, meta: AttentionMetadata, seqs: list[int]) -> None:
        qsl = meta.query_start_loc
        dev = meta.positions.device
        self.meta, self.seqs, self.dev = meta, seqs, dev
        self.starts = [qsl[i] for i in seqs]
        self.ctx = [meta.context_lens[i] for i in seqs]
        self.lens = [qsl[i + 1] - qsl[i] for i in seqs]
        self.slots = [meta.state_slots[i] for i in seqs]
        self.num_rows = meta.num_tokens
        snaps = meta.snapshots
        self.snapshots: list[Sequence[tuple[int, int]]] = (
            [snaps[i] for i in seqs] if snaps and any(snaps[i] for i in seqs) else []
        )
        self._n = torch.tensor(self.lens, device=dev)
        self._ctx = torch.tensor(self.ctx, device=dev)
        self._slot = torch.tensor(self.slots, device=dev)
        j = torch.arange(max(self.lens), device=dev)
        self.valid = j[None, :] < self._n[:, None]  # [S, N]
        self.index = torch.where(
            self.valid, torch.tensor(self.starts, device=dev)[:, None] + j[None, :], 0
        )
        self.pos = self._ctx[:, None] + j[None, :]  # [S, N]
        self.sel = self.valid.flatten().nonzero().flatten()  # valid cells of [S * N]
        self.rows = self.index.flatten()[self.sel]  # their rows in the flat batch
        self.seq_of_row = self.sel // self.index.shape[1]  # [R] each row's sequence
        # each cell's row among the valid cells (row-major), the same for every slice
        self._r_of_cell = self.valid.flatten().cumsum(0).view_as(self.valid) - 1
        self.table = meta.block_tables[torch.tensor(seqs, device=dev)]
        self._j = j
        self._plans: dict[tuple[object, ...], object] = {}

    def parts(self, cols_per_part: int, local: torch.Tensor | None = None) -> list[RowSlice]:
        """The batch's columns in slices of ``cols_per_part`` (one slice: the whole batch).
        ``local`` (bool over the flat batch's rows): only those rows, a CP rank's share,
        packed per sequence first (ascending, padding after), so the slices' O(rows x
        context) work (indexer scores and top-k, entry masks) covers this rank's rows only."""
        s, n = self.index.shape
        if local is None:
            cols, keep = self._j[None, :].expand(s, n), self.valid
        else:
            mine = self.valid & local[self.index]
            n = int(mine.sum(1).max())
            # a stable sort puts each sequence's own columns first, in order
            cols = torch.sort((~mine).to(torch.uint8), dim=1, stable=True).indices[:, :n]
            keep = mine.gather(1, cols)
        step = max(1, cols_per_part)
        return [self._part(cols[:, j : j + step], keep[:, j : j + step]) for j in range(0, n, step)]

    def _part(self, cols: torch.Tensor, keep: torch.Tensor) -> RowSlice:
        sel = keep.flatten().nonzero().flatten()
        index = self.index.gather(1, cols)
        return RowSlice(
            cols,
            index,
            self.pos.gather(1, cols),
            sel,
            index.flatten()[sel],
            self._r_of_cell.gather(1, cols).flatten()[sel],
            sel // cols.shape[1],
        )

    def _tail(self, keep_max: int, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ring rows and batch rows of each chunk's last ``min(n, keep_max)`` positions."""
        keep = self._n.clamp(max=keep_max)
        mask = self.valid & (self._j[None, :] >= (self._n - keep)[:, None])
        cells = mask.flatten().nonzero().flatten()
        rows = (self._slot[:, None] * ring + self.pos % ring).flatten()[cells]
        return rows, self.index.flatten()[cells]

    def window(self, ring: int, w_len: int) -> WindowPlan:
        key = ("window", ring, w_len)
        got = self._plans.get(key)
        if got is None:
            prev_start = (self._ctx - w_len + 1).clamp(min=0)
            older = self._ctx - prev_start
            jp = torch.arange(int(older.max()), device=self.dev)
            p_valid = jp[None, :] < older[:, None]
            p_pos = prev_start[:, None] + jp[None, :]
            read = torch.where(p_valid, self._slot[:, None] * ring + p_pos % ring, 0)
            kpos = torch.cat((p_pos, self.pos), dim=1)
            k_valid = torch.cat((p_valid, self.valid), dim=1)
            got = self._plans[key] = WindowPlan(read, kpos, k_valid, *self._tail(ring, ring), w_len)
        assert isinstance(got, WindowPlan)
        return got

    def window_rows(self, ring: int, w_len: int) -> WindowRows:
        key = ("window-rows", ring, w_len)
        got = self._plans.get(key)
        if got is None:
            dev = self.dev
            prev_start = [max(0, c - w_len + 1) for c in self.ctx]
            n_old = [c - p for c, p in zip(self.ctx, prev_start, strict=True)]
            older = [
                slot * ring + p % ring
                for slot, p0, c in zip(self.slots, prev_start, self.ctx, strict=True)
                for p in range(p0, c)
            ]
            off = torch.tensor([sum(n_old[:i]) for i in range(len(n_old))], device=dev)
            seq = self.seq_of_row
            pos = self.pos.flatten()[self.sel][:, None]  # [R, 1]
            kpos = pos - (w_len - 1) + torch.arange(w_len, device=dev)[None, :]  # [R, W]
            ctx = self._ctx[seq][:, None]
            start = torch.tensor(self.starts, device=dev)[seq][:, None]
            p0 = torch.tensor(prev_start, device=dev)[seq][:, None]
            rows = torch.where(
                kpos >= ctx, start + kpos - ctx, self.num_rows + off[seq][:, None] + kpos - p0
            )
            got = self._plans[key] = WindowRows(
                torch.tensor(older, dtype=torch.long, device=dev),
                torch.where(kpos >= 0, rows, -1).contiguous(),
            )
        assert isinstance(got, WindowRows)
        return got

    def ratio(self, ratio: int, per: int) -> EntryPlan:
        key = ("entries", ratio, per)
        got = self._plans.get(key)
        if got is None:
            total = (self._ctx + self._n) // ratio
            e = torch.arange(int(total.max()), device=self.dev)
            valid = e[None, :] < total[:, None]
            flat = self.table[:, e // per] * per + e % per
            limit = torch.minimum((self.pos + 1) // ratio, total[:, None])
            got = self._plans[key] = EntryPlan(torch.where(valid, flat, 0), limit)
        assert isinstance(got, EntryPlan)
        return got

    def pool(self, ratio: int, per: int, s_len: int, overlap: bool) -> PoolPlan:
        key = ("pool", ratio, per, s_len, overlap)
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = self._pool(ratio, per, s_len, overlap)
        assert isinstance(got, PoolPlan)
        return got

    def _pool(self, r: int, per: int, s_len: int, overlap: bool) -> PoolPlan:
        dev, s = self.dev, len(self.seqs)
        first_w = [c // r for c in self.ctx]
        total = [(c + n) // r for c, n in zip(self.ctx, self.lens, strict=True)]
        base = [max(0, (f - 1) * r) if overlap else f * r for f in first_w]
        n_old = [c - b for c, b in zip(self.ctx, base, strict=True)]
        old_off = [sum(n_old[:i]) for i in range(s)]
        old = [
            self.slots[i] * s_len + p % s_len for i in range(s) for p in range(base[i], self.ctx[i])
        ]
        plan = PoolPlan(
            torch.tensor(old, dtype=torch.long, device=dev),
            torch.empty(0, r, dtype=torch.long, device=dev),
            torch.empty(0, r, dtype=torch.long, device=dev),
            torch.empty(0, dtype=torch.long, device=dev),
            torch.empty(0, dtype=torch.long, device=dev),
            *self._tail(s_len, s_len),
            self.starts,
            self.ctx,
            base,
            old_off,
            self.num_rows,
        )
        who = [i for i in range(s) for _ in range(first_w[i], total[i])]
        if not who:
            return plan
        seq = torch.tensor(who, device=dev)
        wins = torch.tensor([w for i in range(s) for w in range(first_w[i], total[i])], device=dev)
        pos = wins[:, None] * r + torch.arange(r, device=dev)[None, :]  # [Nw, r]

        def source(p: torch.Tensor) -> torch.Tensor:
            ctx = self._ctx[seq][:, None]
            starts = torch.tensor(self.starts, device=dev)[seq][:, None]
            off = torch.tensor(old_off, device=dev)[seq][:, None]
            b = torch.tensor(base, device=dev)[seq][:, None]
            return torch.where(p >= ctx, starts + p - ctx, self.num_rows + off + p - b)

        new_entry = self.table[seq, wins // per] * per + wins % per
        return PoolPlan(
            plan.old,
            source(pos),
            source((pos - r).clamp(min=0)),
            wins,
            new_entry,
            plan.write,
            plan.write_src,
            self.starts,
            self.ctx,
            base,
            old_off,
            self.num_rows,
        )
