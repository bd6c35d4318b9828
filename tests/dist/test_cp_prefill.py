"""Context-parallel prefill on dsv4-tiny over 2 and 3 gloo ranks: a step's prefill chunks
split zig-zag over the ranks (one chunk with context in the rings, one too short to split,
decode rows beside them), the cache inputs all-gathered per layer; every row's logits equal
the single-process step's within docs/models.md's bound (1e-4 of the logit scale)."""

from __future__ import annotations

import pytest

from .cp_cases import v4_cp
from .harness import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world", [2, 3])
def test_cp_prefill_matches_one_process(world: int) -> None:
    results = run_ranks(v4_cp, world=world, timeout=150)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        for case, ratio in r.items():
            if case != "bitwise":
                assert ratio <= 1.0, (rank, case, ratio)
