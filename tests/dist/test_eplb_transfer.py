"""After random re-placements every physical slot holds its logical expert's weights, and
all replicas of an expert are equal (they are compared against the same code)."""

from __future__ import annotations

import pytest

from .eplb_cases import random_moves
from .harness import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(("world", "slots"), [(2, 10), (4, 12)])
def test_weights_follow_random_replacements(world: int, slots: int) -> None:
    results = run_ranks(random_moves, world=world, timeout=120, args=(slots, 4))
    for rank, rounds in enumerate(results):
        for i, r in enumerate(rounds):
            assert r["wrong"] == [], (rank, i, r["wrong"])
    assert sum(r["remote_moves"] for r in results[0]) > 0  # the plans did move weights
