"""Our DeepSeek V4 against transformers' DeepseekV4ForCausalLM (tiny config, same weights)."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk

from .v4_common import build_ours, build_reference, prefill_meta, tiny_v4_dict

pytest.importorskip("transformers")

VOCAB = 320
BLOCK = 64


@pytest.fixture(scope="module")
def pair():  # type: ignore[no-untyped-def]
    d = tiny_v4_dict()
    ours = build_ours(d, seed=1)
    return d, ours, build_reference(d, ours)


def _tol(ref_logits: torch.Tensor) -> float:
    return 1e-4 * float(ref_logits.abs().max())


def test_prefill_logits_match_reference_for_a_batch_of_unequal_sequences(pair) -> None:  # type: ignore[no-untyped-def]
    _, ours, ref = pair
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, VOCAB, (96,), generator=g), torch.randint(0, VOCAB, (61,), generator=g)
    with torch.no_grad():
        ra, rb = ref(a[None]).logits[0], ref(b[None]).logits[0]
        cache = ours.allocate_cache(8, BLOCK, 2)
        lo = ours.compute_logits(ours(torch.cat((a, b)), prefill_meta([96, 61], BLOCK), cache))
    assert (lo[:96] - ra).abs().max() <= _tol(ra)
    assert (lo[96:] - rb).abs().max() <= _tol(rb)
    # not a degenerate model: the reference's greedy tokens vary along the sequence
    assert ra.argmax(-1).unique().numel() > 10


def test_decode_through_cache_matches_full_forward_at_every_position(pair) -> None:  # type: ignore[no-untyped-def]
    """Three sequences share each step: one prefilled then decoded token by token, one fed in
    chunks of 7, one with a long first chunk; 100 tokens each, past the 16-token window and
    across many CSA (4) and HCA (16) blocks."""
    _, ours, ref = pair
    length = 100
    ids = torch.randint(0, VOCAB, (3, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = ref(ids).logits
    cache = ours.allocate_cache(16, BLOCK, 4)
    blocks = {0: [5, 1], 1: [2, 7], 2: [4, 0]}  # deliberately not contiguous
    slots = {0: 2, 1: 0, 2: 3}
    first, later = {0: 20, 1: 7, 2: 37}, {0: 1, 1: 7, 2: 1}
    done = dict.fromkeys(range(3), 0)
    got = torch.zeros(3, length, VOCAB)
    with torch.no_grad():
        while any(v < length for v in done.values()):
            chunks, toks, who = [], [], []
            for i in range(3):
                if done[i] >= length:
                    continue
                n = min(first[i] if done[i] == 0 else later[i], length - done[i])
                chunks.append(SeqChunk(done[i], n, blocks[i], slots[i]))
                toks.append(ids[i, done[i] : done[i] + n])
                who.append((i, done[i], n))
            meta = AttentionMetadata.build(chunks, BLOCK)
            lo = ours.compute_logits(ours(torch.cat(toks), meta, cache))
            for (i, c, n), start in zip(who, meta.query_start_loc, strict=False):
                got[i, c : c + n] = lo[start : start + n]
                done[i] += n
    assert (got - full).abs().max() <= _tol(full)


def test_greedy_generation_is_identical_to_reference(pair) -> None:  # type: ignore[no-untyped-def]
    _, ours, ref = pair
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2))
    new = 40
    with torch.no_grad():
        ref_seq = prompt.clone()
        for _ in range(new):  # the reference's full forward at each step
            nxt = ref(ref_seq[None]).logits[0, -1].argmax()
            ref_seq = torch.cat((ref_seq, nxt[None]))
        cache = ours.allocate_cache(4, BLOCK, 1)
        seq = prompt.clone()
        ctx, step_ids = 0, prompt
        while seq.numel() < prompt.numel() + new:
            meta = AttentionMetadata.build([SeqChunk(ctx, step_ids.numel(), [0], 0)], BLOCK)
            lo = ours.compute_logits(ours(step_ids, meta, cache))
            ctx += step_ids.numel()
            step_ids = lo[-1].argmax()[None]
            seq = torch.cat((seq, step_ids))
    assert torch.equal(seq, ref_seq)


def test_window_only_and_uncompressed_config_matches_too() -> None:
    d = tiny_v4_dict(compress_ratios=[0, 0, 0, 0, 0], num_hash_layers=2, rope_scaling=None)
    d["rope_scaling"] = {"type": "default"}
    ours = build_ours(d, seed=3)
    ref = build_reference(d, ours)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        r = ref(ids[None]).logits[0]
        lo = ours.compute_logits(
            ours(ids, prefill_meta([40], BLOCK), ours.allocate_cache(1, BLOCK, 1))
        )
    assert (lo - r).abs().max() <= _tol(r)
