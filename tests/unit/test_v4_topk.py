"""The indexer's top-k (``attention/v4.py:stable_topk_mask``) picks exactly what the first
``k`` of a stable descending sort pick: ties at the k-th value taken in entry order, masked
(-inf) entries included when fewer than ``k`` are visible."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.attention.v4 import stable_topk_mask

pytestmark = pytest.mark.unit


def by_sort(scores: torch.Tensor, k: int) -> torch.Tensor:
    top = torch.argsort(scores, dim=-1, descending=True, stable=True)[:, : min(k, scores.shape[1])]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)


@pytest.mark.parametrize("k", [0, 1, 3, 16, 40])
def test_the_mask_equals_a_stable_sorts_first_k(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    hidden = torch.rand(64, 40, generator=g) < 0.3
    cases = [
        torch.randn(64, 40, generator=g),
        torch.randn(64, 40, generator=g).relu(),  # many exact zeros: ties at the k-th value
        torch.randint(0, 3, (64, 40), generator=g).float(),
        torch.zeros(64, 40),
    ]
    for scores in cases:
        for s in (scores, scores.masked_fill(hidden, -torch.inf)):
            got = stable_topk_mask(s, k)
            assert torch.equal(got, by_sort(s, k))
            assert got.sum(1).eq(min(k, 40)).all()


def test_ties_go_to_the_earliest_entries() -> None:
    scores = torch.tensor([[1.0, 2.0, 1.0, 1.0, 0.0, 1.0]])
    assert stable_topk_mask(scores, 3).tolist() == [[True, True, True, False, False, False]]
    inf = torch.tensor([[-torch.inf, 5.0, -torch.inf, -torch.inf]])
    assert stable_topk_mask(inf, 3).tolist() == [[True, True, True, False]]
