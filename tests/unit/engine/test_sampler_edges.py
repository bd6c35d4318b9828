"""Sampling parameters at the edge of their ranges still give a distribution (found by fuzzing
the API: a denormal ``top_p`` made every probability NaN and killed the engine core)."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.engine.sample.sampler import probs_from_logits, sample_and_verify
from dsv4_serving.engine.sample.sampling_params import SamplingParams


@pytest.mark.parametrize("top_p", [2.2250738585e-313, 5e-324, 1e-45, 1e-9])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    sp = SamplingParams(temperature=1.0, top_p=top_p)
    probs = probs_from_logits(logits, sp)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert sample_and_verify(logits, [], sp, torch.Generator().manual_seed(0)) == [1]


def test_extreme_temperatures_stay_finite() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    for t in (1e-4, 100.0):
        probs = probs_from_logits(logits, SamplingParams(temperature=t, top_k=2))
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-6
