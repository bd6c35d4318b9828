"""Packed masks applied to logits, checked bit by bit against a plain loop."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_serving.structured.bitmask import allocate_bitmask, apply_bitmask_, unpack_bitmask

pytestmark = pytest.mark.unit


def _reference(logits: torch.Tensor, words: list[list[int]]) -> torch.Tensor:
    out = logits.clone()
    for r, row in enumerate(words):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= len(row) or not (row[w] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 264])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    rng = random.Random(vocab)
    rows = 5
    words = [[rng.getrandbits(32) for _ in range((vocab + 31) // 32)] for _ in range(rows)]
    words[0] = [0xFFFFFFFF] * len(words[0])  # all allowed (bit 31 included: negative int32)
    words[1] = [0] * len(words[1])  # none
    words[2][-1] = 1 << 31  # only the sign bit of the last word
    mask = torch.tensor(
        [[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32
    )
    logits = torch.randn(rows, vocab).to(dtype)
    want = _reference(logits, words)
    got = apply_bitmask_(logits, mask)
    assert got is logits and torch.equal(got, want)


def test_logits_wider_than_mask_are_disallowed() -> None:
    mask = allocate_bitmask(2, 40)  # all allowed, 2 words = 64 ids
    assert mask.shape == (2, 2) and mask.dtype == torch.int32
    logits = torch.zeros(2, 70)
    apply_bitmask_(logits, mask)
    assert torch.isfinite(logits[:, :64]).all() and torch.isinf(logits[:, 64:]).all()
    assert unpack_bitmask(mask, 70).sum().item() == 2 * 64


def test_shape_and_dtype_checked() -> None:
    with pytest.raises(ValueError, match="match"):
        apply_bitmask_(torch.zeros(2, 32), allocate_bitmask(3, 32))
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask_(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
