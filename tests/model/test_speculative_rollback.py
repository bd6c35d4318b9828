"""Rejected speculative rows must not disturb what follows: with ``lookahead`` slack in the
rings, a step that writes junk draft positions past the accepted length leaves the next
steps' logits exactly as if the junk had never been there (the engine relies on this for MTP)."""

from __future__ import annotations

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk

from .v4_common import build_ours, tiny_v4_dict

BLOCK = 16


def test_rejected_draft_rows_leave_later_logits_unchanged() -> None:
    d = tiny_v4_dict()
    model = build_ours(d, seed=5)
    k = 3
    length = 3 * d["sliding_window"] + 9  # wraps the window ring several times
    ids = torch.randint(0, d["vocab_size"], (length,), generator=torch.Generator().manual_seed(5))
    blocks = list(range(-(-(length + k) // BLOCK)))
    junk = torch.randint(0, d["vocab_size"], (k,), generator=torch.Generator().manual_seed(6))

    def step(cache, ctx: int, toks: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        meta = AttentionMetadata.build([SeqChunk(ctx, len(toks), blocks, 0)], BLOCK)
        return model.compute_logits(model(toks, meta, cache))

    with torch.no_grad():
        clean = model.allocate_cache(len(blocks), BLOCK, 1, lookahead=k)
        spec = model.allocate_cache(len(blocks), BLOCK, 1, lookahead=k)
        want, got = [], []
        for p in range(length):
            want.append(step(clean, p, ids[p : p + 1])[-1])
            # the same token followed by k junk drafts, all rejected: only position p is kept
            got.append(step(spec, p, torch.cat((ids[p : p + 1], junk)))[0])
    want_t, got_t = torch.stack(want), torch.stack(got)
    assert (want_t - got_t).abs().max() <= 1e-4 * float(want_t.abs().max())
