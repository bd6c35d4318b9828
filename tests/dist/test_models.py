"""dsv4-tiny and dsv3-small split over 2 and 4 gloo ranks: prefill + decode steps through the
cache give the single-process logits within docs/models.md's bound (1e-4 of the logit scale)."""

from __future__ import annotations

import pytest

from .cases import models_tp2_dp2, models_world2
from .harness import run_ranks

pytestmark = pytest.mark.dist


def _check(results: list[dict[str, float]]) -> None:
    for rank, r in enumerate(results):
        for case, ratio in sorted(r.items()):
            print(f"rank {rank} {case}: max|diff| = {ratio:.3f} x bound")
            assert ratio <= 1.0, (rank, case, ratio)


def test_tp2_ep2_and_dp2_models_match_one_process() -> None:
    results = run_ranks(models_world2, world=2, timeout=150)
    assert {k.split("/")[1] for k in results[0]} == {"tp2", "tp2-ep2", "dp2-ep2", "dp2-ep2-exact"}
    _check(results)


def test_tp2_by_dp2_on_four_ranks_matches_one_process() -> None:
    _check(run_ranks(models_tp2_dp2, world=4, timeout=150))
