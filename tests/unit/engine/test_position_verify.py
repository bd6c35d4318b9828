"""Seeded verification by position (``engine/sample/sampler.py``): a seeded request's token at
an output position is the same whether the step verified drafts or sampled that position alone,
so a stream continued on another engine (whose first step has no drafts) stays exact with MTP;
the kept-draft rate is p(d), rejection sampling's for one-hot drafts."""

from __future__ import annotations

import torch

from dsv4_serving.engine.sample.sampler import sample_and_verify
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.sample.seeding import position_seed

SP = SamplingParams(temperature=1.0, seed=11, max_tokens=64)


def _at(position: int) -> torch.Generator:
    return torch.Generator().manual_seed(position_seed(11, position))


def test_a_seeded_token_depends_on_its_position_not_on_the_drafts() -> None:
    torch.manual_seed(0)
    logits = torch.randn(40, 6)
    alone = [sample_and_verify(logits[i : i + 1], [], SP, _at(i))[0] for i in range(40)]
    for start in range(0, 36, 3):
        for drafts in ([], alone[start : start + 3], [alone[start], 5, 5], [5, 5, 5]):
            rows = logits[start : start + len(drafts) + 1]
            got = sample_and_verify(
                rows, drafts, SP, _at(start), None, lambda i, s=start: _at(s + i)
            )
            assert got == alone[start : start + len(got)]
            kept = len(got) - 1
            assert got[:kept] == drafts[:kept]  # kept drafts, then the position's own token


def test_a_draft_is_kept_with_its_probability() -> None:
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3], [1.0, 1.0, 1.0]]))
    sp = SamplingParams(temperature=1.0, max_tokens=4)
    gen = torch.Generator().manual_seed(3)
    kept = sum(len(sample_and_verify(logits, [1], sp, gen)) == 2 for _ in range(4000))
    assert abs(kept / 4000 - 0.5) < 0.03
