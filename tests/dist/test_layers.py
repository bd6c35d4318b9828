"""Each split layer equals its unsplit version on 2 gloo ranks (one spawn runs every case)."""

from __future__ import annotations

import pytest

from .harness import run_ranks
from .layer_cases import layers_world2

pytestmark = pytest.mark.dist

# float32 sums in another order: relative to the output's scale
CLOSE = 1e-5


@pytest.fixture(scope="module")
def results() -> list[dict[str, float]]:
    return run_ranks(layers_world2, world=2, timeout=120)


def test_tp_linears_embedding_and_head_equal_their_unsplit_versions(
    results: list[dict[str, float]],
) -> None:
    for r in results:
        assert r["embedding_equal"] == 0.0  # one rank holds each row: exact
        for name in ("column", "row", "swiglu", "lm_head"):
            assert r[name] < CLOSE, (name, r[name])


def test_v4_attention_and_mla_split_by_heads_equal_unsplit(
    results: list[dict[str, float]],
) -> None:
    for r in results:
        for name in ("v4_attention_layer0", "v4_attention_layer1", "v4_attention_layer2", "mla"):
            assert r[name] < CLOSE, (name, r[name])


@pytest.mark.parametrize("kind", ["tp2", "tp2-ep2", "tp2-ep2-exact", "dp2-ep2", "dp2-ep2-exact"])
def test_moe_under_tp_and_ep_equals_single_process(
    results: list[dict[str, float]], kind: str
) -> None:
    for r in results:
        for moe in ("v4moe", "v4moe_scored", "v3moe"):
            assert r[f"{moe}/{kind}"] < CLOSE, (moe, r[f"{moe}/{kind}"])


@pytest.mark.parametrize("kind", ["tp2-ep2-exact", "dp2-ep2-exact"])
def test_exact_mode_routed_experts_are_bitwise_single_process(
    results: list[dict[str, float]], kind: str
) -> None:
    for r in results:
        for moe in ("v4moe", "v4moe_scored", "v3moe"):
            assert r[f"{moe}/{kind}/routed_bitwise_differs"] == 0.0, moe
