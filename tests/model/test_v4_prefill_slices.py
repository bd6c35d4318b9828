"""V4 prefill's query side in slices of rows (``V4Attention._prefill``, ``SLICE_BYTES``): the
indexer scores, entry masks and torch-path logits of a long prompt are O(rows x context), so
a layer computes them a slice of columns of the padded batch at a time. The slices change
nothing: logits and every cache tensor are bit-identical (``torch.equal``) to one slice over
the whole batch, on the kernel and the torch path, with chunks that have context in the rings
and a decode row beside them."""

from __future__ import annotations

import pytest
import torch

import dsv4_serving.attention.v4 as v4a
from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.attention.v4_prefill_plan import PrefillChunks
from dsv4_serving.kernels.v4_attn import V4AttnKernel

from .v4_common import build_ours, tiny_v4_dict

pytestmark = pytest.mark.model
VOCAB, BLOCK = 320, 64
# (first chunk, later chunks) per sequence: one long prompt then chunks, one whole, one decoded
PLAN = {0: (230, 61), 1: (170, 170), 2: (40, 1)}
LENGTH = {0: 352, 1: 170, 2: 44}


def run(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each step's logits and the cache afterwards."""
    g = torch.Generator().manual_seed(3)
    ids = {i: torch.randint(0, VOCAB, (n,), generator=g) for i, n in LENGTH.items()}
    cache = model.allocate_cache(24, BLOCK, 4)  # type: ignore[operator]
    blocks = {0: [5, 1, 9, 11, 3, 12], 1: [2, 7, 14], 2: [4]}
    done = dict.fromkeys(LENGTH, 0)
    steps = []
    with torch.no_grad():
        while any(done[i] < LENGTH[i] for i in LENGTH):
            chunks, toks = [], []
            for i, (first, later) in PLAN.items():
                if done[i] < LENGTH[i]:
                    n = min(first if done[i] == 0 else later, LENGTH[i] - done[i])
                    chunks.append(SeqChunk(done[i], n, blocks[i], i))
                    toks.append(ids[i][done[i] : done[i] + n])
                    done[i] += n
            meta = AttentionMetadata.build(chunks, BLOCK)
            steps.append(model.compute_logits(model(torch.cat(toks), meta, cache)))  # type: ignore[operator]
    tensors = [t.clone() for layer in cache.layers for t in layer.tensors()]
    return steps, tensors


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_slices_are_bit_identical_to_one_pass(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "torch":
        monkeypatch.setattr(v4a, "V4_ATTN", V4AttnKernel(use_kernel=False))
    model = build_ours(tiny_v4_dict(), seed=2)
    whole_logits, whole_cache = run(model)
    parts_seen: list[int] = []
    real_parts = PrefillChunks.parts

    def counting(self: PrefillChunks, cols: int, local: torch.Tensor | None = None) -> list:  # type: ignore[type-arg]
        got = real_parts(self, cols, local)
        parts_seen.append(len(got))
        return got

    monkeypatch.setattr(PrefillChunks, "parts", counting)
    for budget in (1, 40_000):  # one column per slice; a few dozen columns
        parts_seen.clear()
        monkeypatch.setattr(v4a, "SLICE_BYTES", budget)
        logits, cache = run(model)
        assert max(parts_seen) > 5  # the long chunks really ran in several slices
        assert len(logits) == len(whole_logits)
        for a, b in zip(logits, whole_logits, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(cache, whole_cache, strict=True):
            assert torch.equal(a, b)


def test_slice_size_follows_the_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CSA layer of a 352-token chunk: 88 entries; per column the indexer's 8 heads of f32
    scores twice, the mask, tie counts and entry indices: 88 x (8 x 8 + 25) bytes."""
    model = build_ours(tiny_v4_dict(), seed=2)
    cache = model.allocate_cache(24, BLOCK, 4)  # type: ignore[operator]
    meta = AttentionMetadata.build([SeqChunk(0, 352, [0, 1, 2, 3, 4, 5], 0)], BLOCK)
    chunks = PrefillChunks(meta, [0])
    csa = model.layers[1].attn  # type: ignore[index]
    assert csa.indexer is not None
    wp = chunks.window(cache.layers[1].window.shape[1], csa.window)
    per_col = 88 * (8 * 8 + 25)
    monkeypatch.setattr(v4a, "SLICE_BYTES", 10 * per_col)
    assert csa.prefill_cols(chunks, cache.layers[1], wp, kernel=True) == 10
    monkeypatch.setattr(v4a, "SLICE_BYTES", 1)
    assert csa.prefill_cols(chunks, cache.layers[1], wp, kernel=True) == 1
    cols = [p.cols[0].tolist() for p in chunks.parts(150)]
    assert cols == [list(range(0, 150)), list(range(150, 300)), list(range(300, 352))]
