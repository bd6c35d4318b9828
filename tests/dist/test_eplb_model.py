"""The balancer on a real model over 2 gloo ranks (DP 2 or TP 2 x EP 2, exact combine, 2 redundant
slots, a re-placement every 2 steps on skewed prompts): each step's logits stay those of one
process while layers move, and afterwards every slot's stacks, quantized weights and their
scales, are its logical expert's."""

from __future__ import annotations

import pytest

from .eplb_cases import model_replacement
from .harness import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    ("layout", "quant"), [("dp2", "none"), ("dp2", "fp4"), ("tp2", "none")]
)  # fp8 linears do not split over TP 2 at dsv4-tiny's sizes (128-wide blocks)
def test_live_replacement_keeps_outputs_and_moves_scales_with_weights(
    layout: str, quant: str
) -> None:
    results = run_ranks(model_replacement, world=2, timeout=240, args=(quant, layout))
    for rank, per_model in enumerate(results):
        for preset, r in per_model.items():
            assert r["wrong"] == [], (rank, preset, r["wrong"][:5])
            assert r["rearrangements"] >= 1, (rank, preset)
            assert r["moved_slots"] > 0, (rank, preset)
            # a replica computes a subset of its expert's tokens: GEMM rounding, not bitwise
            assert r["worst"] < 1e-5, (rank, preset, r["worst"])
            if quant == "fp4":
                assert "w1_scale" in r["params"]
