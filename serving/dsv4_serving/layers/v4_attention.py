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

from collections.abc import Sequence

import torch
from torch import nn

from dsv4_serving.cache.metadata import AttentionMetadata
from dsv4_serving.cache.paged import gather_entries, scatter_entries
from dsv4_serving.cache.v4 import V4LayerCache
from dsv4_serving.cache.v4_step import RatioPlan, V4DecodeStep, V4Step
from dsv4_serving.distributed.groups import SOLO, Group
from dsv4_serving.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from dsv4_serving.layers.norm import RMSNorm, rms_norm
from dsv4_serving.layers.quant.methods import QuantMethod, QuantMethods
from dsv4_serving.layers.rope import Rotary, rotate_tail_interleaved
from dsv4_serving.layers.shard import ShardSpec
from dsv4_serving.models.config import DeepseekV4Config


class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens (two overlapping series when ``overlap``)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        coff = 2 if overlap else 1
        # DeepSeek ships the compressor (and the indexer's weights_proj) unquantized
        self.wkv = ReplicatedLinear(dim, coff * head_dim)
        self.wgate = ReplicatedLinear(dim, coff * head_dim)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim))
        self.norm = RMSNorm(head_dim, eps)
        self.ratio, self.overlap, self.head_dim = ratio, overlap, head_dim

    @property
    def state_len(self) -> int:
        return (2 if self.overlap else 1) * self.ratio

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Raw per-token state ``[kv | gate]``, what the cache keeps for unfinished blocks."""
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def pool(
        self, proj: torch.Tensor, base: int, first_w: int, n_win: int, rotary: Rotary
    ) -> torch.Tensor:
        """Entries ``first_w .. first_w + n_win - 1`` from ``proj`` rows at positions
        ``base ..`` -> ``[n_win, head_dim]``, normed and rotated at their block start."""
        r = self.ratio
        wins = torch.arange(first_w, first_w + n_win, device=proj.device)
        offs = torch.arange(r, device=proj.device)
        cur = wins[:, None] * r - base + offs[None, :]  # [n_win, r] rows of the block itself
        prev = proj[(cur - r).clamp(min=0)] if self.overlap else None
        return self.pool_rows(proj[cur], prev, wins, rotary)

    def pool_rows(
        self, cur: torch.Tensor, prev: torch.Tensor | None, wins: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """Entries ``wins`` from the raw rows of their own block ``cur`` ``[N, r, 2 * width]``
        and (overlap) of the block before ``prev`` (ignored for entry 0) -> ``[N, head_dim]``."""
        r, d = self.ratio, self.head_dim
        width = cur.shape[-1] // 2
        kv, gate = cur[..., :width], cur[..., width:]
        ape = self.ape.float()
        if prev is None:
            k = kv.float()
            g = gate.float() + ape
        else:
            k_cur = kv[..., d:].float()
            g_cur = gate[..., d:].float() + ape[:, d:]
            has_prev = (wins >= 1)[:, None, None]
            k_prev = torch.where(has_prev, prev[..., :d].float(), 0.0)
            g_prev = torch.where(
                has_prev, prev[..., width : width + d].float() + ape[:, :d], -torch.inf
            )
            k = torch.cat((k_prev, k_cur), dim=1)
            g = torch.cat((g_prev, g_cur), dim=1)
        pooled = (k * g.softmax(dim=1)).sum(dim=1).to(cur.dtype)
        pooled = self.norm(pooled)
        cos, sin = rotary.cos_sin(wins * r)
        return rotate_tail_interleaved(pooled, cos, sin)


class Indexer(nn.Module):
    """Lightning indexer: ``score(t, w) = sum_h relu(q_th . k_w) * scale * weight_th``."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int, quant: QuantMethod | None = None) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.wq_b = ReplicatedLinear(
            cfg.q_lora_rank, self.n_heads * self.head_dim, quant or QuantMethod()
        )
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, True, cfg.rms_norm_eps)


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

    def forward(self, x: torch.Tensor, step: V4Step, cache: V4LayerCache) -> torch.Tensor:
        """``step``: this step's plan from the attention backend (``platform/v4_torch.py``),
        built once per step: every decode sequence in one batched pass, longer chunks one
        sequence at a time."""
        meta = step.meta
        t = x.shape[0]
        h, d = self.n_heads, self.head_dim
        cos, sin = meta.cos_sin(self.rotary)
        q_res = self.q_norm(self.wq_a(x))
        q = rms_norm(self.wq_b(q_res).view(t, h, d), None, self.eps)
        q = rotate_tail_interleaved(q, cos, sin)
        kv = rotate_tail_interleaved(self.kv_norm(self.wkv(x)), cos, sin)

        comp_proj = self.compressor.project(x) if self.compressor is not None else None
        idx_q = idx_w = idx_proj = None
        if self.indexer is not None:
            ix = self.indexer
            ccos, csin = meta.cos_sin(self.rotary_comp)
            idx_q = ix.wq_b(q_res).view(t, ix.n_heads, ix.head_dim)
            idx_q = rotate_tail_interleaved(idx_q, ccos, csin)
            idx_w = ix.weights_proj(x).float() * ix.n_heads**-0.5
            idx_proj = ix.compressor.project(x)

        dec = step.decode
        if dec is not None and dec.size == t:  # a decode-only step: every row, no gathers
            out = self._decode(dec, q, kv, comp_proj, idx_q, idx_w, idx_proj, cache)
            dec = None
        else:
            out = torch.empty_like(q)
        if dec is not None:
            r = dec.rows

            def pick(y: torch.Tensor | None) -> torch.Tensor | None:
                return None if y is None else y[r]

            out[r] = self._decode(
                dec, q[r], kv[r], pick(comp_proj), pick(idx_q), pick(idx_w), pick(idx_proj), cache
            )
        for i in step.prefill:
            a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[a:b] = self._sequence(
                i, a, b, q[a:b], kv[a:b], comp_proj, idx_q, idx_w, idx_proj, meta, cache
            )
        out = rotate_tail_interleaved(out, cos, sin, inverse=True)
        g = self.o_groups
        wo_a = self.wo_a.weight.view(g, -1, h * d // g)
        grouped = torch.einsum("tgi,goi->tgo", out.reshape(t, g, -1), wo_a)
        return self.wo_b(grouped.flatten(1))

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
    ) -> torch.Tensor:
        """Every sequence with one new token at once: ``q`` ``[B, h, d]`` -> ``[B, h, d]``.
        Same math as ``_sequence`` (window keys, compressed entries the indexer keeps, sinks),
        over padded rows whose invalid keys are masked."""
        win = cache.window
        ring = dec.ring(win.shape[1], self.window)
        flat = win.view(-1, win.shape[-1])
        flat[ring.write] = kv.to(win.dtype)  # the ring never holds p - W + 1 .. p twice
        keys = flat[ring.read]  # [B, W, d], positions p - W + 1 .. p
        scale = self.head_dim**-0.5
        qf = q.float()
        logits = torch.einsum("bhd,bkd->bhk", qf, keys.float()) * scale
        parts = [logits.masked_fill(~ring.read_valid[:, None, :], -torch.inf)]
        values = [keys]
        if self.compressor is not None:
            assert cache.comp is not None and comp_proj is not None
            plan = dec.ratio(self.ratio)
            comp = self._advance_decode(
                self.compressor, cache.comp, cache.comp_state, dec, plan, comp_proj
            )
            visible = plan.entries_valid
            if self.indexer is not None:
                assert cache.index is not None and idx_proj is not None
                assert idx_q is not None and idx_w is not None
                idx_keys = self._advance_decode(
                    self.indexer.compressor, cache.index, cache.index_state, dec, plan, idx_proj
                )
                scores = torch.einsum("bhd,bed->bhe", idx_q.float(), idx_keys.float())
                visible = visible & self._topk(scores, idx_w, visible)
            if plan.num_entries:
                cl = torch.einsum("bhd,bed->bhe", qf, comp.float()) * scale
                parts.append(cl.masked_fill(~visible[:, None, :], -torch.inf))
                values.append(comp)
        probs = self._with_sinks(parts, head_dim=1)
        v = torch.cat(values, dim=1).float()
        return torch.einsum("bhk,bkd->bhd", probs, v).to(q.dtype)

    def _advance_decode(
        self,
        comp: Compressor,
        store: torch.Tensor,
        state: torch.Tensor | None,
        dec: V4DecodeStep,
        plan: RatioPlan,
        proj: torch.Tensor,
    ) -> torch.Tensor:
        """``_advance`` for one token per sequence: keep its raw row, pool the blocks it
        completes, return every sequence's entries so far ``[B, E, head_dim]``."""
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
        return flat_store[plan.entries]

    def _with_sinks(self, parts: list[torch.Tensor], head_dim: int) -> torch.Tensor:
        """Softmax over the concatenated logits with each head's sink in the denominator."""
        shape = [1] * parts[0].dim()
        shape[head_dim] = -1
        sink = self.attn_sink.float().view(shape).expand(*parts[0].shape[:-1], 1)
        return torch.cat([*parts, sink], dim=-1).softmax(dim=-1)[..., :-1]

    def _sequence(
        self,
        i: int,
        a: int,
        b: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        comp_proj: torch.Tensor | None,
        idx_q: torch.Tensor | None,
        idx_w: torch.Tensor | None,
        idx_proj: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: V4LayerCache,
    ) -> torch.Tensor:
        ctx, n, slot = meta.context_lens[i], b - a, meta.state_slots[i]
        w_len = self.window
        ring = cache.window.shape[1]  # >= w_len: speculative rows must not evict live ones
        dev = q.device
        qpos = torch.arange(ctx, ctx + n, device=dev)
        # read everything from the rings before this step overwrites them
        prev_start = max(0, ctx - w_len + 1)
        prev_pos = torch.arange(prev_start, ctx, device=dev)
        keys = torch.cat((cache.window[slot, prev_pos % ring], kv), dim=0)
        kpos = torch.cat((prev_pos, qpos))
        snaps = meta.snapshots[i] if meta.snapshots else ()
        for boundary, dst in snaps:
            # the ring as it stood after position boundary - 1, for a later prefix-cache hit
            ps = torch.arange(max(0, boundary - w_len + 1), boundary, device=dev)
            cache.window[dst, ps % ring] = keys[ps - prev_start].to(cache.window.dtype)
        comp = idx_keys = None
        if self.compressor is not None:
            assert comp_proj is not None
            block_row = meta.block_tables[i]
            comp, idx_keys = self._compress_step(
                i, a, b, ctx, n, slot, block_row, comp_proj, idx_proj, cache, snaps
            )
        self._write_window(cache, slot, ctx, kv)

        scale = self.head_dim**-0.5
        logits = torch.einsum("nhd,kd->hnk", q.float(), keys.float()) * scale
        # the masks depend on the sequence's positions only: built by its first layer
        key = ("v4-window-hidden", i, w_len)
        hidden = meta.memo.get(key)
        if hidden is None:
            allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - w_len)
            hidden = meta.memo[key] = ~allowed[None]
        assert isinstance(hidden, torch.Tensor)
        logits = logits.masked_fill(hidden, -torch.inf)
        parts = [logits]
        values = [keys]
        if comp is not None and comp.shape[0] > 0:
            r = self.ratio
            e = comp.shape[0]
            vkey = ("v4-entries-visible", i, r, e)
            visible = meta.memo.get(vkey)
            if visible is None:  # [n, E]
                visible = meta.memo[vkey] = (
                    torch.arange(e, device=dev)[None, :] < ((qpos + 1) // r)[:, None]
                )
            assert isinstance(visible, torch.Tensor)
            if self.indexer is not None:
                assert idx_q is not None and idx_w is not None and idx_keys is not None
                visible = visible & self._select(idx_q[a:b], idx_w[a:b], idx_keys, visible)
            cl = torch.einsum("nhd,ed->hne", q.float(), comp.float()) * scale
            parts.append(cl.masked_fill(~visible[None], -torch.inf))
            values.append(comp)
        probs = self._with_sinks(parts, head_dim=0)
        v = torch.cat(values, dim=0).float()
        return torch.einsum("hnk,kd->nhd", probs, v).to(q.dtype)

    def _select(
        self, iq: torch.Tensor, iw: torch.Tensor, ik: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Indexer top-k over the visible entries of one sequence: [n, E] bool."""
        scores = torch.einsum("nhd,ed->nhe", iq.float(), ik.float())
        return self._topk(scores, iw, visible)

    def _topk(self, scores: torch.Tensor, iw: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """``scores`` [n, H, E] (query-key dot products per indexer head), ``iw`` [n, H] ->
        the ``index_topk`` best visible entries per query, [n, E] bool."""
        assert self.indexer is not None
        scores = scores.relu() * self.indexer.head_dim**-0.5
        scores = (scores * iw[:, :, None]).sum(dim=1)  # [n, E]
        scores = scores.masked_fill(~visible, -torch.inf)
        k = min(self.indexer.topk, scores.shape[1])
        # a stable sort breaks ties (ReLU makes exact zeros common) by entry order, so a
        # query picks the same entries whether its sequence arrived whole, chunked or
        # decoded token by token; topk's tie order depends on the number of entries
        top = torch.argsort(scores, dim=-1, descending=True, stable=True)[:, :k]
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, top, True)
        return chosen

    def _write_window(self, cache: V4LayerCache, slot: int, ctx: int, kv: torch.Tensor) -> None:
        n, w_len = kv.shape[0], cache.window.shape[1]
        keep = min(n, w_len)
        pos = torch.arange(ctx + n - keep, ctx + n, device=kv.device)
        cache.window[slot, pos % w_len] = kv[n - keep :].to(cache.window.dtype)

    def _compress_step(
        self,
        i: int,
        a: int,
        b: int,
        ctx: int,
        n: int,
        slot: int,
        block_row: torch.Tensor,
        comp_proj: torch.Tensor,
        idx_proj: torch.Tensor | None,
        cache: V4LayerCache,
        snaps: Sequence[tuple[int, int]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pool the blocks this step completes, store them, return all entries so far."""
        assert self.compressor is not None and cache.comp is not None
        r = self.ratio
        first_w = ctx // r
        total = (ctx + n) // r
        n_win = total - first_w
        comp = self._advance(
            self.compressor,
            cache.comp,
            cache.comp_state,
            slot,
            block_row,
            ctx,
            n,
            comp_proj[a:b],
            first_w,
            n_win,
            total,
            snaps,
        )
        idx_keys = None
        if self.indexer is not None:
            assert idx_proj is not None and cache.index is not None
            idx_keys = self._advance(
                self.indexer.compressor,
                cache.index,
                cache.index_state,
                slot,
                block_row,
                ctx,
                n,
                idx_proj[a:b],
                first_w,
                n_win,
                total,
                snaps,
            )
        return comp, idx_keys

    def _advance(
        self,
        comp: Compressor,
        store: torch.Tensor,
        state: torch.Tensor | None,
        slot: int,
        block_row: torch.Tensor,
        ctx: int,
        n: int,
        proj: torch.Tensor,
        first_w: int,
        n_win: int,
        total: int,
        snaps: Sequence[tuple[int, int]] = (),
    ) -> torch.Tensor:
        assert state is not None
        # the ring may be longer than the compressor needs (room for speculative rows)
        r, s_len = comp.ratio, state.shape[1]
        dev = proj.device
        base = max(0, (first_w - 1) * r) if comp.overlap else first_w * r
        old_pos = torch.arange(base, ctx, device=dev)
        rows = torch.cat((state[slot, old_pos % s_len].to(proj.dtype), proj), dim=0)
        for boundary, dst in snaps:
            # the rows a step starting at ``boundary`` reads (none for HCA: blocks end there)
            lo = max(0, (boundary // r - 1) * r) if comp.overlap else boundary // r * r
            ps = torch.arange(lo, boundary, device=dev)
            state[dst, ps % s_len] = rows[ps - base].to(state.dtype)
        if n_win > 0:
            pooled = comp.pool(rows, base, first_w, n_win, self.rotary_comp)
            scatter_entries(store, block_row, torch.arange(first_w, total, device=dev), pooled)
        keep = min(n, s_len)
        pos = torch.arange(ctx + n - keep, ctx + n, device=dev)
        state[slot, pos % s_len] = proj[n - keep :].to(state.dtype)
        return gather_entries(store, block_row, total)
