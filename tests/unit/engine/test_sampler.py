"""Sampling, speculative verification (greedy and rejection sampling), logprobs."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.engine.sample.sampler import (
    compute_logprobs,
    probs_from_logits,
    sample_and_verify,
)
from dsv4_serving.engine.sample.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def test_greedy_verification_keeps_the_matching_prefix_then_the_model_token() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, t in enumerate((3, 4, 5, 6)):
        logits[row, t] = 5.0
    assert sample_and_verify(logits, [3, 4, 5], GREEDY, None) == [3, 4, 5, 6]  # all kept + bonus
    assert sample_and_verify(logits, [3, 9, 5], GREEDY, None) == [3, 4]  # second draft wrong
    assert sample_and_verify(logits[:1], [], GREEDY, None) == [3]


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = p.log().expand(2, 3).clone()
    sp = SamplingParams(temperature=1.0, seed=1)
    gen = torch.Generator().manual_seed(1)
    n = 6000
    first = torch.zeros(3)
    accepted = 0
    for _ in range(n):
        out = sample_and_verify(logits, [1], sp, gen)
        first[out[0]] += 1
        accepted += out[0] == 1 and len(out) == 2
    assert torch.allclose(first / n, p, atol=0.025)  # whatever the draft, tokens follow p
    assert abs(accepted / n - 0.3) < 0.025  # a draft is kept with probability p(draft)


def test_top_k_and_top_p_mask_the_tail() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    pk = probs_from_logits(logits, SamplingParams(top_k=2))
    assert (pk[0, 2:] == 0).all() and pk[0, :2].sum() == pytest.approx(1.0)
    pp = probs_from_logits(logits, SamplingParams(top_p=0.7))
    assert pp[0, 0] > 0 and pp[0, 1] > 0 and (pp[0, 2:] == 0).all()


def test_seeded_sampling_repeats() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=1.0, seed=7)
    a = [sample_and_verify(logits, [], sp, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_logprobs_are_the_raw_log_softmax_with_the_best_alternatives() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    (lp,) = compute_logprobs(logits, [1], 2)
    ref = torch.log_softmax(logits, -1)[0]
    assert lp.logprob == pytest.approx(float(ref[1]))
    assert [t for t, _ in lp.top] == [0, 1]


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"max_tokens": 0},
        {"logprobs": 21},
        {"stop": [""]},
        {"min_tokens": 5, "max_tokens": 2},
    ],
)
def test_invalid_sampling_params_raise(kw: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)
