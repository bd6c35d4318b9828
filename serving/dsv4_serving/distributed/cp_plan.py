"""The context-parallel (CP) plan of one prefill chunk: which of its tokens each CP rank
computes, what the ranks exchange, and what that costs per rank.

**Split** (zig-zag, the head-tail load balance of causal work): a chunk of ``tokens`` new
tokens after ``context`` cached ones is cut into ``2 x cp`` parts of whole ``align``-token
blocks (the last part takes the remainder); rank ``r`` owns parts ``r`` and ``2cp - 1 - r``, so
every rank gets one early (cheap) and one late (expensive) stretch of the causal triangle. A
chunk shorter than ``2 x cp`` blocks is not split: every rank computes all of it (vLLM's and
SGLang's rule; a split that small costs more in collectives than it saves).

**Exchange** (design "gather cache inputs"): queries and everything per token (projections,
MoE, norms, mHC streams, the indexer's queries and top-k, the attention itself) run on the
rank's own rows; the cache inputs are all-gathered once per layer and restored to token
order: the shared K=V row (the window's keys), and on compressed layers the compressor's raw
projections (and the indexer compressor's on CSA layers). Every rank then pools the compressed
KV and the indexer keys over the whole chunk and writes an identical, replicated cache, so
window masks and top-k stay exact at part boundaries and a non-CP decode reads the cache as
it would a single rank's. V3's MLA gathers its latent rows (``kv_lora_rank + rope``).

**Work** is counted in key visits per query, per layer: the window's keys, the compressed
entries attended (CSA: at most ``index_topk``; HCA: all visible), the entries the indexer
scores (CSA), or every earlier token (dense MLA). A proxy: it weighs a visit the same on
every layer kind. Pure Python: no torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CPLayer:
    """One attention layer as the CP plan sees it."""

    kind: str  # "window" | "csa" | "hca" | "mla"
    gathered: int  # elements per token all-gathered over CP
    ratio: int = 0  # compression ratio (csa / hca)


@dataclass(frozen=True, slots=True)
class CPModel:
    """What the plan needs of a model's config (built by the caller from it)."""

    layers: tuple[CPLayer, ...]
    hidden_size: int
    streams: int = 1  # residual streams per token (V4's mHC: hc_mult)
    window: int = 0  # V4's sliding window (0: dense causal)
    index_topk: int = 0
    index_heads: int = 0
    dtype_bytes: int = 2

    @classmethod
    def v4(cls, cfg: Any, dtype_bytes: int = 2) -> CPModel:
        """From a ``DeepseekV4Config`` (the MTP layer is left out)."""
        d, idx_d = cfg.head_dim, cfg.index_head_dim
        layers = []
        for r in cfg.compress_ratios[: cfg.num_hidden_layers]:
            if r == 0:
                layers.append(CPLayer("window", d))
            elif r == cfg.csa_ratio:  # K=V, the overlapping compressor [kv | gate], indexer's
                layers.append(CPLayer("csa", d + 4 * d + 4 * idx_d, r))
            else:
                layers.append(CPLayer("hca", d + 2 * d, r))
        return cls(
            tuple(layers),
            cfg.hidden_size,
            cfg.hc_mult,
            cfg.sliding_window,
            cfg.index_topk,
            cfg.index_n_heads,
            dtype_bytes,
        )

    @classmethod
    def mla(cls, cfg: Any, dtype_bytes: int = 2) -> CPModel:
        """From a ``DeepseekV3Config``: the latent row ``kv_lora_rank + qk_rope_head_dim``."""
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        layers = tuple(CPLayer("mla", width) for _ in range(cfg.num_hidden_layers))
        return cls(layers, cfg.hidden_size, dtype_bytes=dtype_bytes)


def _sum_min(n: int, cap: int) -> int:
    """sum of min(x, cap) for x = 1 .. n."""
    if n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


def _sum_floor(n: int, r: int) -> int:
    """sum of x // r for x = 1 .. n."""
    q, rem = divmod(n, r)
    return r * q * (q - 1) // 2 + q * (rem + 1)


def _sum_floor_capped(n: int, r: int, cap: int) -> int:
    """sum of min(cap, x // r) for x = 1 .. n."""
    if n < cap * r:
        return _sum_floor(n, r)
    return _sum_floor(cap * r - 1, r) + (n - cap * r + 1) * cap


def _visits_upto(model: CPModel, layer: CPLayer, n: int) -> int:
    """Key visits of the queries at positions 0 .. n - 1 on ``layer``."""
    if layer.kind == "mla" or not model.window:
        return n * (n + 1) // 2
    visits = _sum_min(n, model.window)
    if layer.kind == "csa":  # attended top-k, plus the indexer's scoring of every entry
        visits += _sum_floor_capped(n, layer.ratio, model.index_topk)
        visits += _sum_floor(n, layer.ratio)
    elif layer.kind == "hca":
        visits += _sum_floor(n, layer.ratio)
    return visits


def key_visits(model: CPModel, spans: tuple[tuple[int, int], ...]) -> int:
    """Key visits of the queries at positions ``spans`` ([start, end) each), all layers."""
    total = 0
    kinds: dict[CPLayer, int] = {}
    for layer in model.layers:
        kinds[layer] = kinds.get(layer, 0) + 1
    for layer, count in kinds.items():
        per = sum(_visits_upto(model, layer, b) - _visits_upto(model, layer, a) for a, b in spans)
        total += count * per
    return total


@dataclass(frozen=True, slots=True)
class CPRank:
    """One CP rank's share of a chunk: absolute positions and rows of the chunk it computes."""

    rank: int
    spans: tuple[tuple[int, int], ...]  # [start, end) positions, ascending
    rows: int
    key_visits: int
    residual_bytes: int  # the residual stream of its rows (all streams)
    indexer_bytes: int  # the indexer's scores of its rows in one pass (f32), before slicing


@dataclass(frozen=True, slots=True)
class CPPlan:
    """The CP plan of one chunk (see the module doc)."""

    context: int
    tokens: int
    cp: int
    align: int
    split: bool  # False: every rank computes every row (too short, or cp 1)
    ranks: tuple[CPRank, ...]
    gathered_bytes_per_token: tuple[int, ...]  # per layer
    kv_bytes: int  # the cache of the whole sequence, replicated on every CP rank

    @classmethod
    def build(
        cls,
        model: CPModel,
        tokens: int,
        cp: int,
        align: int = 128,
        context: int = 0,
        kv_bytes_per_block: int = 0,
        kv_bytes_per_seq: int = 0,
    ) -> CPPlan:
        """``kv_bytes_per_block`` / ``kv_bytes_per_seq``: the cache's bytes per ``align``-token
        block and per sequence (V4's window and compressor state), from the KV cache class."""
        if cp < 1 or tokens < 1 or align < 1 or context < 0:
            raise ValueError(f"cp {cp}, tokens {tokens}, align {align}, context {context}")
        parts = split_chunk(tokens, cp, align)
        split = len(parts[0]) > 1
        ranks = []
        csa = [layer.ratio for layer in model.layers if layer.kind == "csa"]
        entries = (context + tokens) // min(csa) if csa else 0  # the padded batch's E
        for r, local in enumerate(parts):
            spans = tuple((context + a, context + b) for a, b in local)
            rows = sum(b - a for a, b in local)
            ranks.append(
                CPRank(
                    r,
                    spans,
                    rows,
                    key_visits(model, spans),
                    rows * model.hidden_size * model.streams * model.dtype_bytes,
                    rows * model.index_heads * entries * 4,
                )
            )
        per_token = tuple(layer.gathered * model.dtype_bytes for layer in model.layers)
        total_blocks = -(-(context + tokens) // align)
        kv = total_blocks * kv_bytes_per_block + kv_bytes_per_seq
        return cls(context, tokens, cp, align, split, tuple(ranks), per_token, kv)

    def gathered_bytes(self, rank: int) -> int:
        """Bytes ``rank`` receives over all layers: every other rank's rows of each layer's
        cache inputs (nothing when the chunk is not split)."""
        if not self.split:
            return 0
        others = self.tokens - self.ranks[rank].rows
        return others * sum(self.gathered_bytes_per_token)

    def gathered_buffer_bytes(self) -> int:
        """The largest layer's gathered cache inputs, the whole chunk: live during a layer."""
        if not self.split:
            return 0
        return self.tokens * max(self.gathered_bytes_per_token, default=0)

    def imbalance(self) -> float:
        """Most key visits of a rank over the mean (1.0: perfectly balanced)."""
        visits = [r.key_visits for r in self.ranks]
        return max(visits) * len(visits) / max(1, sum(visits))


def split_chunk(tokens: int, cp: int, align: int) -> list[list[tuple[int, int]]]:
    """Chunk rows ``[start, end)`` of each rank: ``2cp`` parts of whole blocks (the first
    ``blocks % 2cp`` parts one block longer, the last truncated at ``tokens``), rank r owns
    r and 2cp-1-r; every rank the whole chunk when it has fewer than ``2cp`` blocks."""
    blocks = -(-tokens // align)
    if cp == 1 or blocks < 2 * cp:
        return [[(0, tokens)] for _ in range(cp)]
    base, extra = divmod(blocks, 2 * cp)
    bounds = [0]
    for i in range(2 * cp):
        bounds.append(min(tokens, bounds[-1] + (base + (i < extra)) * align))
    parts = list(itertools.pairwise(bounds))
    return [[parts[r], parts[2 * cp - 1 - r]] for r in range(cp)]


def local_rows(
    starts: list[int], lens: list[int], cp: int, rank: int, align: int
) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` of a flat batch that CP ``rank`` computes: each prefill chunk
    (its first row and length) split by ``split_chunk``."""
    return [
        (start + a, start + b)
        for start, n in zip(starts, lens, strict=True)
        for a, b in split_chunk(n, cp, align)[rank]
    ]


# What each tensor of an attention layer does under CP (printed by ``dsv4 explain-model``).
SPLIT_BY_SEQUENCE = (
    "queries (wq_a, wq_b), the indexer's queries and weights, its scores and top-k",
    "attention output, o-projection, MoE, norms, the residual (mHC) streams",
)
SPLIT_BY_SEQUENCE_MLA = (
    "queries (q_a, q_b), attention output, o-projection, MLP / MoE, norms, the residual",
)
GATHERED = (
    "the shared K=V rows (the window's keys)",
    "the compressor's raw projections (compressed KV, pooled on every rank)",
    "the indexer compressor's raw projections (indexer keys, pooled on every rank)",
)
GATHERED_MLA = ("the latent rows (kv_lora_rank + rope): keys and values expanded on every rank",)
