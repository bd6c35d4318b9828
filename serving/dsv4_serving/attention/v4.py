"""DeepSeek V4 attention over a flat batch, reading and writing the hybrid cache.

One shared K=V head (``head_dim``) per token, with RoPE on its trailing ``qk_rope_head_dim``
channels; every layer attends to a ``sliding_window`` of recent tokens plus, on compressed
layers, to compressed entries: HCA (ratio ``m'``) pools each block of ``m'`` tokens into one
entry, CSA (ratio ``m``) pools overlapping ``2m``-token spans and a lightning indexer keeps the
``index_topk`` best entries per query. Entry ``w`` becomes visible to a query at position ``t``
once its block is complete: ``w < (t + 1) // ratio``. Per-head sinks join the softmax
denominator; the output's rope channels are rotated back by the query's angle, then a grouped
low-rank projection mixes the heads.

Under TP (vllm-ascend's split) a rank holds ``heads / tp`` query heads, their sinks and their
``o_groups / tp`` output groups (``wq_b`` and ``wo_a`` column-parallel, ``wo_b`` row-parallel);
the shared KV head, compressor, indexer and the cache are replicated on every TP rank.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from dsv4_serving.attention.cp import CPShare
from dsv4_serving.attention.kv_cache.v4 import V4LayerCache
from dsv4_serving.attention.v4_compressor import Compressor, Indexer, rotate_tail
from dsv4_serving.attention.v4_prefill_plan import (
    PoolPlan,
    PrefillChunks,
    RowSlice,
    WindowPlan,
    prefill_chunks,
)
from dsv4_serving.attention.v4_step import RatioPlan, V4DecodeStep, V4Step
from dsv4_serving.distributed.groups import SOLO, Group
from dsv4_serving.kernels.v4_attn import V4_ATTN
from dsv4_serving.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from dsv4_serving.layers.norm import RMSNorm, rms_norm
from dsv4_serving.layers.quant.methods import QuantMethods
from dsv4_serving.layers.rope import Rotary
from dsv4_serving.layers.shard import ShardSpec
from dsv4_serving.models.config import DeepseekV4Config

# a prefill slice's query-side buffers (indexer scores, entry masks, torch-path logits) stay
# under this many bytes: a 64K-token prompt's indexer scores alone are O(rows x entries)
SLICE_BYTES = 256 << 20


def stable_topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[n, E]`` bool: each row's ``k`` highest scores, ties broken by entry order (the
    first ``k`` of a stable descending sort), so a query picks the same entries whether its
    sequence arrived whole, chunked or decoded token by token (ReLU makes exact zeros common;
    ``topk``'s own tie order depends on the number of entries). O(E) per row: everything
    above the k-th value, then the ties at it in order until ``k`` are taken."""
    k = min(k, scores.shape[-1])
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tie = scores == kth
    need = k - above.sum(dim=-1, keepdim=True, dtype=torch.int32)
    return above | (tie & (tie.cumsum(dim=-1, dtype=torch.int32) <= need))


class V4Attention(nn.Module):
    def __init__(
        self,
        cfg: DeepseekV4Config,
        layer: int,
        rotary_main: Rotary,
        rotary_comp: Rotary,
        tp: Group = SOLO,
        quant: QuantMethods | None = None,
    ) -> None:
        super().__init__()
        q = (quant or QuantMethods()).linear
        d, h, g = cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
        first_head, local_heads = tp.split(h)
        self.n_heads, self.head_dim, self.window = local_heads, d, cfg.sliding_window
        self.o_groups = tp.split(g)[1]
        self.eps = cfg.rms_norm_eps
        self.ratio = cfg.layer_ratio(layer)
        self.wq_a = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, q)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, h * d, tp, q)
        self.wkv = ReplicatedLinear(cfg.hidden_size, d, q)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        # wo_a stays in the compute dtype (dequantized at load): it is applied per group
        # through its matrix (the grouped einsum below)
        self.wo_a = ColumnParallelLinear(h * d // g, g * cfg.o_lora_rank, tp)
        self.wo_b = RowParallelLinear(g * cfg.o_lora_rank, cfg.hidden_size, tp, quant=q)
        self.attn_sink = nn.Parameter(torch.zeros(local_heads))
        self.shards: dict[str, ShardSpec] = {}
        if tp.size > 1:
            self.shards["attn_sink"] = ShardSpec(0, first_head, local_heads, h)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.ratio:
            csa = self.ratio == cfg.csa_ratio
            self.compressor = Compressor(cfg.hidden_size, d, self.ratio, csa, cfg.rms_norm_eps)
            if csa:
                self.indexer = Indexer(cfg, self.ratio, q)
        # window-only layers use the plain rope; compressed layers the YaRN "compress" rope
        self.rotary = rotary_comp if self.ratio else rotary_main
        self.rotary_comp = rotary_comp

    def forward(
        self,
        x: torch.Tensor,
        step: V4Step,
        cache: V4LayerCache,
        local: torch.Tensor | None = None,
        cp: CPShare | None = None,
    ) -> torch.Tensor:
        """``step``: this step's plan from the attention backend
        (``attention/backends/v4_torch.py``), built once per step: every decode sequence in one
        batched pass, the longer chunks in another. With the kernel the queries' rope (and its
        inverse on the output) happens inside it. ``local`` (bool ``[T]``): a context-parallel
        rank's prefill rows (``distributed/cp_plan.py:local_rows``); the cache is written for
        every row, attention runs for these only, other prefill rows come out zero. ``cp``:
        context parallel, ``x`` holds the rank's rows (``CPShare.rows``) and so does the
        result; the cache inputs of every row are all-gathered first."""
        meta = step.meta
        h, d = self.n_heads, self.head_dim
        cos, sin = meta.cos_sin(self.rotary)
        ccos, csin = meta.cos_sin(self.rotary_comp)
        if cp is not None:  # x holds this rank's rows: project them, gather the cache inputs
            local = cp.mask
            q, kv, comp_proj, idx_q, idx_w, idx_proj, kernel = self._project(
                x, cache, cos[cp.rows], sin[cp.rows], ccos[cp.rows], csin[cp.rows]
            )
            q, idx_q, idx_w = (None if y is None else cp.scatter(y) for y in (q, idx_q, idx_w))
            ins = [y for y in (kv, comp_proj, idx_proj) if y is not None]
            got = iter(cp.gather(ins))
            kv = next(got)
            comp_proj = None if comp_proj is None else next(got)
            idx_proj = None if idx_proj is None else next(got)
            assert q is not None
        else:
            q, kv, comp_proj, idx_q, idx_w, idx_proj, kernel = self._project(
                x, cache, cos, sin, ccos, csin
            )
        t = q.shape[0]

        dec = step.decode
        if dec is not None and dec.size == t:  # a decode-only step: every row, no gathers
            rope = (cos, sin) if kernel else None
            out = self._decode(dec, q, kv, comp_proj, idx_q, idx_w, idx_proj, cache, rope)
            dec = None
        else:
            out = torch.empty_like(q)
        if dec is not None:
            r = dec.rows

            def pick(y: torch.Tensor | None) -> torch.Tensor | None:
                return None if y is None else y[r]

            rope = (cos[r], sin[r]) if kernel else None
            args = (pick(comp_proj), pick(idx_q), pick(idx_w), pick(idx_proj))
            out[r] = self._decode(dec, q[r], kv[r], *args, cache, rope)
        if step.prefill:
            chunks = prefill_chunks(step)
            rope = (cos[chunks.rows], sin[chunks.rows]) if kernel else None
            out[chunks.rows] = self._prefill(
                chunks, q, kv, comp_proj, idx_q, idx_w, idx_proj, cache, rope, local
            )
        if not kernel:
            out = rotate_tail(out, cos, sin, inverse=True)
        if cp is not None:
            out, t = out[cp.rows], cp.rows.shape[0]
        g = self.o_groups
        wo_a = self.wo_a.weight.view(g, -1, h * d // g)
        grouped = torch.einsum("tgi,goi->tgo", out.reshape(t, g, -1), wo_a)
        return self.wo_b(grouped.flatten(1))

    def _project(
        self,
        x: torch.Tensor,
        cache: V4LayerCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ccos: torch.Tensor,
        csin: torch.Tensor,
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor | None,
        torch.Tensor | None,
        torch.Tensor | None,
        bool,
    ]:
        """Per-row projections of ``x``: queries (rotated unless the kernel does it), the K=V
        row, the compressor's raw rows, the indexer's queries, weights and raw rows."""
        t = x.shape[0]
        h, d = self.n_heads, self.head_dim
        q_res = self.q_norm(self.wq_a(x))
        q = rms_norm(self.wq_b(q_res).view(t, h, d), None, self.eps)
        kernel = self._kernel(q, cache) is not None
        if not kernel:
            q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(self.wkv(x)), cos, sin)
        comp_proj = self.compressor.project(x) if self.compressor is not None else None
        idx_q = idx_w = idx_proj = None
        if self.indexer is not None:
            ix = self.indexer
            idx_q = ix.wq_b(q_res).view(t, ix.n_heads, ix.head_dim)
            idx_q = rotate_tail(idx_q, ccos, csin)
            idx_w = ix.weights_proj(x).float() * ix.n_heads**-0.5
            idx_proj = ix.compressor.project(x)
        return q, kv, comp_proj, idx_q, idx_w, idx_proj, kernel

    def _decode(
        self,
        dec: V4DecodeStep,
        q: torch.Tensor,
        kv: torch.Tensor,
        comp_proj: torch.Tensor | None,
        idx_q: torch.Tensor | None,
        idx_w: torch.Tensor | None,
        idx_proj: torch.Tensor | None,
        cache: V4LayerCache,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Every sequence with one new token at once: ``q`` ``[B, h, d]`` -> ``[B, h, d]``.
        Same math as ``_sequence`` (window keys, compressed entries the indexer keeps, sinks),
        over padded rows whose invalid keys are masked."""
        win = cache.window
        ring = dec.ring(win.shape[1], self.window)
        flat = win.view(-1, win.shape[-1])
        flat[ring.write] = kv.to(win.dtype)  # the ring never holds p - W + 1 .. p twice
        ext = self._kernel(q, cache)
        comp = visible = None
        if self.compressor is not None:
            assert cache.comp is not None and comp_proj is not None
            plan = dec.ratio(self.ratio)
            comp = self._advance_decode(
                self.compressor, cache.comp, cache.comp_state, dec, plan, comp_proj, ext is None
            )
            visible = plan.entries_valid
            if self.indexer is not None:
                assert cache.index is not None and idx_proj is not None
                assert idx_q is not None and idx_w is not None
                idx_keys = self._advance_decode(
                    self.indexer.compressor, cache.index, cache.index_state, dec, plan, idx_proj
                )
                assert idx_keys is not None
                scores = torch.einsum("bhd,bed->bhe", idx_q.float(), idx_keys.float())
                visible = visible & self._topk(scores, idx_w, visible)
            if not plan.num_entries:
                comp = visible = None
        if ext is not None:
            csrc, cidx = flat, ring.read[:, :0]
            if visible is not None:
                assert cache.comp is not None
                csrc = cache.comp.view(-1, cache.comp.shape[-1])
                cidx = torch.where(visible, plan.entries, -1)
            kidx = torch.where(ring.read_valid, ring.read, -1)
            sink, scale = self.attn_sink.float(), self.head_dim**-0.5
            out: torch.Tensor = ext.v4_attn(
                q.contiguous(), flat, kidx, csrc, cidx, sink, scale, *self._rope_args(rope)
            )
            return out
        keys = flat[ring.read]  # [B, W, d], positions p - W + 1 .. p
        scale = self.head_dim**-0.5
        qf = q.float()
        logits = torch.einsum("bhd,bkd->bhk", qf, keys.float()) * scale
        parts = [logits.masked_fill(~ring.read_valid[:, None, :], -torch.inf)]
        values = [keys]
        if comp is not None and visible is not None:
            cl = torch.einsum("bhd,bed->bhe", qf, comp.float()) * scale
            parts.append(cl.masked_fill(~visible[:, None, :], -torch.inf))
            values.append(comp)
        probs = self._with_sinks(parts, head_dim=1)
        v = torch.cat(values, dim=1).float()
        return torch.einsum("bhk,bkd->bhd", probs, v).to(q.dtype)

    @staticmethod
    def _rope_args(
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's cos / sin rows (empty: the queries are rotated already)."""
        if rope is None:
            return torch.empty(0), torch.empty(0)
        return rope[0].contiguous(), rope[1].contiguous()

    def _kernel(self, q: torch.Tensor, cache: V4LayerCache) -> ModuleType | None:
        """The attention kernel when it applies (CPU, float32 or bfloat16 queries and cache),
        else None."""
        if cache.window.dtype not in V4_ATTN.dtypes:
            return None
        return V4_ATTN.get(q)

    def _advance_decode(
        self,
        comp: Compressor,
        store: torch.Tensor,
        state: torch.Tensor | None,
        dec: V4DecodeStep,
        plan: RatioPlan,
        proj: torch.Tensor,
        gather: bool = True,
    ) -> torch.Tensor | None:
        """``_advance_prefill`` for one token per sequence: keep its raw row, pool the blocks
        it completes, return every sequence's entries so far ``[B, E, head_dim]`` (``gather``;
        else None)."""
        assert state is not None
        r, span = comp.ratio, comp.state_len
        ring = dec.ring(state.shape[1], span)
        flat_state = state.view(-1, state.shape[-1])
        flat_state[ring.write] = proj.to(state.dtype)
        flat_store = store.view(-1, store.shape[-1])
        if plan.done.numel():
            # the completing token's span: its own block last, the block before first (CSA)
            rows = flat_state[ring.read[plan.done]].to(proj.dtype)
            prev = rows[:, :r] if comp.overlap else None
            pooled = comp.pool_rows(rows[:, span - r :], prev, plan.done_win, self.rotary_comp)
            flat_store[plan.done_entry] = pooled.to(store.dtype)
        return flat_store[plan.entries] if gather else None

    def _with_sinks(self, parts: list[torch.Tensor], head_dim: int) -> torch.Tensor:
        """Softmax over the concatenated logits with each head's sink in the denominator."""
        shape = [1] * parts[0].dim()
        shape[head_dim] = -1
        sink = self.attn_sink.float().view(shape).expand(*parts[0].shape[:-1], 1)
        return torch.cat([*parts, sink], dim=-1).softmax(dim=-1)[..., :-1]

    def _topk(self, scores: torch.Tensor, iw: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """``scores`` [n, H, E] (query-key dot products per indexer head; overwritten), ``iw``
        [n, H] -> the ``index_topk`` best visible entries per query, [n, E] bool."""
        assert self.indexer is not None
        scores = scores.relu_().mul_(self.indexer.head_dim**-0.5)
        scores = scores.mul_(iw[:, :, None]).sum(dim=1)  # [n, E]
        scores = scores.masked_fill_(~visible, -torch.inf)
        return stable_topk_mask(scores, self.indexer.topk)

    def _prefill(
        self,
        chunks: PrefillChunks,
        q: torch.Tensor,
        kv: torch.Tensor,
        comp_proj: torch.Tensor | None,
        idx_q: torch.Tensor | None,
        idx_w: torch.Tensor | None,
        idx_proj: torch.Tensor | None,
        cache: V4LayerCache,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        local: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every sequence with more than one new token at once, as a padded batch
        ``[S, N]``: window keys (the ring's older rows, then the chunk's own), the compressed
        entries (the blocks the chunks complete pooled first), the indexer's top-k, sinks.
        Returns the chunks' rows ``[R, h, d]`` (``chunks.rows`` of the batch). With the kernel
        every query reads its window keys and selected entries in place instead. The cache
        writes cover the whole batch; the query side runs in slices of columns
        (``prefill_cols``) so its O(rows x context) buffers stay within ``SLICE_BYTES``."""
        win = cache.window
        ext = self._kernel(q, cache)
        wp = chunks.window(win.shape[1], self.window)
        # every read of the ring comes before this step's rows are written into it
        keys, ksrc = self._prefill_window_keys(chunks, wp, kv, win, kernel=ext is not None)
        comp = idx_keys = None
        if self.compressor is not None:
            assert cache.comp is not None and comp_proj is not None
            comp = self._advance_prefill(
                self.compressor, cache.comp, cache.comp_state, chunks, comp_proj, ext is None
            )
            if self.indexer is not None:
                assert cache.index is not None and idx_proj is not None
                idx_keys = self._advance_prefill(
                    self.indexer.compressor, cache.index, cache.index_state, chunks, idx_proj
                )
        win.view(-1, win.shape[-1])[wp.write] = kv[wp.write_src].to(win.dtype)
        shape = (chunks.rows.shape[0], *q.shape[1:])
        out = q.new_empty(shape) if local is None else q.new_zeros(shape)
        cols = self.prefill_cols(chunks, cache, wp, kernel=ext is not None)
        for part in chunks.parts(cols, local):
            visible = self._prefill_visible(chunks, part, cache, idx_q, idx_w, idx_keys)
            if ext is not None:
                assert ksrc is not None
                prope = None if rope is None else (rope[0][part.r], rope[1][part.r])
                out[part.r] = self._prefill_kernel(
                    ext, chunks, part, q, ksrc, visible, cache, prope
                )
            else:
                assert keys is not None
                out[part.r] = self._prefill_torch(part, wp, q, keys, comp, visible)
        return out

    def prefill_cols(
        self, chunks: PrefillChunks, cache: V4LayerCache, wp: WindowPlan, kernel: bool
    ) -> int:
        """Columns of the padded batch per query slice: as many as keep one slice's scores,
        masks and logits (bytes per column, a generous count of the live buffers) within
        ``SLICE_BYTES``; at least one."""
        e = 0
        if self.compressor is not None:
            assert cache.comp is not None
            e = chunks.ratio(self.ratio, cache.comp.shape[1]).entries.shape[1]
        idx_heads = self.indexer.n_heads if self.indexer is not None else 0
        # indexer scores and their weighted copies (f32), the mask, tie counts and cidx (i64)
        per_col = e * (8 * idx_heads + 8 + 17)
        if not kernel:  # logits, masked copies and probabilities over window and entries
            per_col += 12 * self.n_heads * (wp.kpos.shape[1] + e + 1)
        return max(1, SLICE_BYTES // max(1, len(chunks.seqs) * per_col))

    def _prefill_window_keys(
        self,
        chunks: PrefillChunks,
        wp: WindowPlan,
        kv: torch.Tensor,
        win: torch.Tensor,
        kernel: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The window keys as the torch path reads them, ``[S, P + N, d]`` (also for
        snapshots), and as the kernel does, ``cat(kv, ring rows before the chunks)``."""
        flat_win = win.view(-1, win.shape[-1])
        keys = ksrc = None
        if not kernel or chunks.snapshots:
            keys = kv[chunks.index]  # [S, N, d]
            if wp.read.shape[1]:  # positions before the chunks, read before the ring is written
                keys = torch.cat((flat_win[wp.read].to(kv.dtype), keys), dim=1)
            if chunks.snapshots:
                self._snapshot_window(chunks, wp, keys, win)
        if kernel:  # the chunks' keys, then the ring rows before them
            wk = chunks.window_rows(win.shape[1], self.window)
            ksrc = kv if not wk.older.numel() else torch.cat((kv, flat_win[wk.older].to(kv.dtype)))
        return keys, ksrc

    def _prefill_visible(
        self,
        chunks: PrefillChunks,
        part: RowSlice,
        cache: V4LayerCache,
        idx_q: torch.Tensor | None,
        idx_w: torch.Tensor | None,
        idx_keys: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """``[S, n, E]`` bool: the compressed entries each query of the slice attends to
        (complete before it and, on CSA layers, among the indexer's top-k); None where there
        are none."""
        if self.compressor is None:
            return None
        assert cache.comp is not None
        rp = chunks.ratio(self.ratio, cache.comp.shape[1])
        if not rp.entries.shape[1]:
            return None
        visible = rp.visible(part)
        if self.indexer is not None:
            assert idx_q is not None and idx_w is not None and idx_keys is not None
            s, n = part.index.shape
            scores = torch.einsum("snhd,sed->snhe", idx_q[part.index].float(), idx_keys.float())
            chosen = self._topk(
                scores.flatten(0, 1), idx_w[part.index].flatten(0, 1), visible.flatten(0, 1)
            )
            visible = visible & chosen.view(s, n, -1)
        return visible

    def _prefill_kernel(
        self,
        ext: ModuleType,
        chunks: PrefillChunks,
        part: RowSlice,
        q: torch.Tensor,
        ksrc: torch.Tensor,
        visible: torch.Tensor | None,
        cache: V4LayerCache,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The kernel's pass over a slice: every query row reads its window keys and entries
        in place."""
        wk = chunks.window_rows(cache.window.shape[1], self.window)
        kidx = wk.kidx[part.r]
        sink = self.attn_sink.float()
        if visible is None:
            csrc, cidx = ksrc, kidx[:, :0]
        else:
            assert cache.comp is not None
            csrc = cache.comp.view(-1, cache.comp.shape[-1])
            ent = chunks.ratio(self.ratio, cache.comp.shape[1]).entries[part.seq_of_row]
            cidx = torch.where(visible.flatten(0, 1)[part.sel], ent, -1)
        q_rows = q[part.rows].contiguous()
        scale = self.head_dim**-0.5
        out: torch.Tensor = ext.v4_attn(
            q_rows, ksrc, kidx.contiguous(), csrc, cidx, sink, scale, *self._rope_args(rope)
        )
        return out

    def _prefill_torch(
        self,
        part: RowSlice,
        wp: WindowPlan,
        q: torch.Tensor,
        keys: torch.Tensor,
        comp: torch.Tensor | None,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """The torch pass over a slice of the padded batch: masked window and entry logits,
        sinks."""
        scale = self.head_dim**-0.5
        qf = q[part.index].float()  # [S, n, h, d]
        logits = torch.einsum("snhd,skd->shnk", qf, keys.float()) * scale
        parts = [logits.masked_fill(wp.hidden(part)[:, None], -torch.inf)]
        values = [keys]
        if comp is not None and visible is not None:
            cl = torch.einsum("snhd,sed->shne", qf, comp.float()) * scale
            parts.append(cl.masked_fill(~visible[:, None], -torch.inf))
            values.append(comp)
        probs = self._with_sinks(parts, head_dim=1)
        v = torch.cat(values, dim=1).float()
        out = torch.einsum("shnk,skd->snhd", probs, v).to(q.dtype)
        return out.flatten(0, 1)[part.sel]

    def _advance_prefill(
        self,
        comp: Compressor,
        store: torch.Tensor,
        state: torch.Tensor | None,
        chunks: PrefillChunks,
        proj: torch.Tensor,
        gather: bool = True,
    ) -> torch.Tensor | None:
        """Pool the blocks the chunks complete (their rows from the state ring and the chunks'
        own projections), store them, keep the chunks' last rows in the ring, and return every
        sequence's entries so far ``[S, E, head_dim]`` (padded with row 0)."""
        assert state is not None
        per, s_len = store.shape[1], state.shape[1]
        pp = chunks.pool(comp.ratio, per, s_len, comp.overlap)
        flat_state = state.view(-1, state.shape[-1])
        flat_store = store.view(-1, store.shape[-1])
        src = proj
        if pp.old.numel():  # rows of positions before the chunks, from the ring
            src = torch.cat((proj, flat_state[pp.old].to(proj.dtype)))
        if chunks.snapshots:
            self._snapshot_state(chunks, pp, comp, state, src)
        if pp.wins.numel():
            prev = src[pp.prev] if comp.overlap else None
            pooled = comp.pool_rows(src[pp.cur], prev, pp.wins, self.rotary_comp)
            flat_store[pp.new_entry] = pooled.to(store.dtype)
        flat_state[pp.write] = proj[pp.write_src].to(state.dtype)
        return flat_store[chunks.ratio(comp.ratio, per).entries] if gather else None

    def _snapshot_window(
        self, chunks: PrefillChunks, wp: WindowPlan, keys: torch.Tensor, win: torch.Tensor
    ) -> None:
        """The ring as it stood after position ``boundary - 1``, for a later prefix-cache hit."""
        ring, older = win.shape[1], wp.read.shape[1]
        for s, snaps in enumerate(chunks.snapshots):
            ctx = chunks.ctx[s]
            prev_start = max(0, ctx - self.window + 1)
            for boundary, dst in snaps:
                ps = torch.arange(max(0, boundary - self.window + 1), boundary, device=keys.device)
                col = torch.where(ps < ctx, ps - prev_start, older + ps - ctx)
                win[dst, ps % ring] = keys[s, col].to(win.dtype)

    def _snapshot_state(
        self,
        chunks: PrefillChunks,
        pp: PoolPlan,
        comp: Compressor,
        state: torch.Tensor,
        src: torch.Tensor,
    ) -> None:
        """The rows a step starting at ``boundary`` reads (none for HCA: blocks end there)."""
        r, s_len = comp.ratio, state.shape[1]
        for s, snaps in enumerate(chunks.snapshots):
            for boundary, dst in snaps:
                lo = max(0, (boundary // r - 1) * r) if comp.overlap else boundary // r * r
                ps = torch.arange(lo, boundary, device=src.device)
                state[dst, ps % s_len] = src[pp.source(s, ps)].to(state.dtype)
