"""Routed experts in the compute dtype go through one batched product per matrix
(``Experts._grouped``): the same outputs as one expert at a time (``_per_expert``, the path of
quantized weights), for decode- and prefill-sized batches, skewed routing, the clamped SwiGLU,
and a rank holding only some experts (choices of the others are zero)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv4_serving.layers.moe import Experts
from dsv4_serving.loader.dummy import init_dummy_weights

pytestmark = pytest.mark.model
E, D, INTER, K = 8, 48, 32, 2


def experts(limit: float) -> Experts:
    ex = Experts(E, D, INTER, limit)
    init_dummy_weights(nn.Sequential(ex), seed=3)
    return ex


def routing(t: int, seed: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g)
    if skew:  # most tokens on expert 5: one long row of the padded buffer
        idx = torch.stack((torch.full((t,), 5), torch.randint(0, E, (t,), generator=g)), 1)
        idx[:, 1] = torch.where(idx[:, 1] == 5, 6, idx[:, 1])
    else:
        idx = torch.rand(t, E, generator=g).argsort(dim=1)[:, :K]
    return x, idx, torch.rand(t, K, generator=g)


@pytest.mark.parametrize(
    ("t", "skew", "limit"), [(1, False, 0.0), (64, False, 10.0), (700, True, 0.5)]
)
def test_grouped_equals_one_expert_at_a_time(t: int, skew: bool, limit: float) -> None:
    ex = experts(limit)
    x, idx, w = routing(t, t, skew)
    with torch.no_grad():
        got, want = ex._grouped(x, idx, w), ex._per_expert(x, idx, w)
    assert got.shape == (t, K, D)
    assert (got - want).abs().max() <= 1e-5 * float(want.abs().max())
    assert float(want.abs().max()) > 0


def test_a_rank_with_some_experts_leaves_the_others_zero() -> None:
    ex = experts(0.0)
    x, idx, w = routing(40, 1, False)
    with torch.no_grad():
        full = ex._grouped(x, idx, w)
        for name in ("w1", "w2", "w3"):  # this rank: experts 2..5
            setattr(ex, name, nn.Parameter(getattr(ex, name)[2:6].clone()))
        ex.first = 2
        part, ref = ex._grouped(x, idx, w), ex._per_expert(x, idx, w)
    mine = ((idx >= 2) & (idx < 6))[..., None]
    assert (part - ref).abs().max() <= 1e-6
    assert torch.equal(part == 0, ~mine.expand_as(part) | (full == 0))
    assert (part - torch.where(mine, full, 0)).abs().max() <= 1e-5 * float(full.abs().max())
