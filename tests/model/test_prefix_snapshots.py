"""State snapshots written inside a chunk: continuing a sequence from the snapshot taken at a
block boundary (sharing the paged blocks before it) gives the logits of the uninterrupted
run. This is what prefix caching of V4's window ring and compressor state relies on."""

from __future__ import annotations

import copy

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk

from .v4_common import build_ours, tiny_v4_dict

BLOCK = 16


def test_continuing_from_an_in_chunk_snapshot_matches_the_full_run() -> None:
    d = tiny_v4_dict()
    model = build_ours(d, seed=9)
    length = 3 * d["sliding_window"] + 21  # past the window; CSA 4 and HCA 16 blocks complete
    ids = torch.randint(0, d["vocab_size"], (length,), generator=torch.Generator().manual_seed(9))
    blocks = list(range(-(-length // BLOCK)))
    bounds = [16, 32, 48]
    snaps = [(b, 1 + j) for j, b in enumerate(bounds)]  # slot 0 runs, slots 1-3 hold snapshots
    with torch.no_grad():
        cache = model.allocate_cache(len(blocks), BLOCK, 4, lookahead=2)
        meta = AttentionMetadata.build([SeqChunk(0, length, blocks, 0, snaps)], BLOCK)
        full = model.compute_logits(model(ids, meta, cache))
        for b, slot in snaps:
            c = copy.deepcopy(cache)
            # a "second request": context b from the shared blocks and the snapshot slot
            m = AttentionMetadata.build([SeqChunk(b, length - b, blocks, slot)], BLOCK)
            got = model.compute_logits(model(ids[b:], m, c))
            tol = 1e-4 * float(full.abs().max())
            assert (got - full[b:]).abs().max() <= tol, b
            # a snapshot slot left stale (no snapshot written) must not pass
        stale = copy.deepcopy(cache)
        for t in stale.state_tensors():
            t[3].zero_()
        m = AttentionMetadata.build([SeqChunk(48, length - 48, blocks, 3)], BLOCK)
        bad = model.compute_logits(model(ids[48:], m, stale))
        assert (bad - full[48:]).abs().max() > 1e-2
