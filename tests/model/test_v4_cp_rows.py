"""A context-parallel rank's share of a V4 prefill (``V4Attention.forward(..., local=...)``
with ``distributed/cp_plan.py:local_rows``), in one process: every rank writes a cache
bit-identical to the single-rank step's, and each rank's attention rows are bit-identical to
the single-rank rows, on window-only, CSA and HCA layers, for zig-zag-split chunks with
context in the rings, a chunk too short to split and a decode row beside them (both
replicated on every rank). The CP forward's remaining parts (local rows through the rest of
the model, the all-gather of the cache inputs) run over these same calls."""

from __future__ import annotations

import copy

import pytest
import torch

import dsv4_serving.attention.v4 as v4a
from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.distributed.cp_plan import local_rows
from dsv4_serving.kernels.v4_attn import V4AttnKernel

from .v4_common import build_ours, tiny_v4_dict

pytestmark = pytest.mark.model
VOCAB, BLOCK, ALIGN = 320, 64, 16
BLOCKS = {0: [5, 1, 9, 11, 3, 12, 13, 15], 1: [2, 7, 14], 2: [4], 3: [6]}


def prior(model: torch.nn.Module) -> object:
    """Context for the tested step: 200 tokens of sequence 0, 30 of 2 and 40 of 3."""
    cache = model.allocate_cache(16, BLOCK, 4)  # type: ignore[operator]
    g = torch.Generator().manual_seed(5)
    chunks = [SeqChunk(0, 200, BLOCKS[0], 0), SeqChunk(0, 30, BLOCKS[2], 2)]
    chunks.append(SeqChunk(0, 40, BLOCKS[3], 3))
    meta = AttentionMetadata.build(chunks, BLOCK)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (270,), generator=g), meta, cache)  # type: ignore[operator]
    return cache


def step_meta() -> AttentionMetadata:
    """300 more tokens of 0, 150 new of 1 (both split), 20 more of 3 (too short), 1 of 2."""
    chunks = [
        SeqChunk(200, 300, BLOCKS[0], 0),
        SeqChunk(0, 150, BLOCKS[1], 1),
        SeqChunk(40, 20, BLOCKS[3], 3),
        SeqChunk(30, 1, BLOCKS[2], 2),
    ]
    return AttentionMetadata.build(chunks, BLOCK)


def rank_rows(meta: AttentionMetadata, cp: int, rank: int) -> torch.Tensor:
    qsl = meta.query_start_loc
    prefill = [i for i in range(len(qsl) - 1) if qsl[i + 1] - qsl[i] > 1]
    starts = [qsl[i] for i in prefill]
    lens = [qsl[i + 1] - qsl[i] for i in prefill]
    mask = torch.zeros(meta.num_tokens, dtype=torch.bool)
    for a, b in local_rows(starts, lens, cp, rank, ALIGN):
        mask[a:b] = True
    return mask


@pytest.mark.parametrize(("path", "cp"), [("kernel", 2), ("kernel", 3), ("torch", 2)])
def test_cp_ranks_write_the_same_cache_and_compute_their_rows_exactly(
    path: str, cp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "torch":
        monkeypatch.setattr(v4a, "V4_ATTN", V4AttnKernel(use_kernel=False))
    model = build_ours(tiny_v4_dict(), seed=4)
    before = prior(model)
    g = torch.Generator().manual_seed(6)
    decode_row = 470  # the 1-token chunk of sequence 2, after 300 + 150 + 20 rows
    masks = [rank_rows(step_meta(), cp, r) for r in range(cp)]
    # the split chunks' rows once over the ranks; the short chunk's on every rank
    counts = torch.stack(masks).sum(0)
    assert counts[:450].eq(1).all() and counts[450:470].eq(cp).all()
    assert not counts[decode_row]
    for i, block in enumerate(model.layers):  # type: ignore[attr-defined]
        x = torch.randn(471, 64, generator=g)
        meta = step_meta()
        whole_cache = copy.deepcopy(before)
        step = model.attention_backend(x.device).plan(meta, BLOCK)  # type: ignore[operator]
        with torch.no_grad():
            whole = block.attn(x, step, whole_cache.layers[i])  # type: ignore[attr-defined]
        for r, mask in enumerate(masks):
            cache = copy.deepcopy(before)
            step = model.attention_backend(x.device).plan(step_meta(), BLOCK)  # type: ignore[operator]
            with torch.no_grad():
                mine = block.attn(x, step, cache.layers[i], local=mask)  # type: ignore[attr-defined]
            for a, b in zip(
                cache.layers[i].tensors(), whole_cache.layers[i].tensors(), strict=True
            ):  # type: ignore[attr-defined]
                assert torch.equal(a, b), (cp, r, i)
            rows = mask.clone()
            rows[decode_row] = True
            assert torch.equal(mine[rows], whole[rows]), (cp, r, i)
