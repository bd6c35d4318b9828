from __future__ import annotations

import pytest

from dsv4_serving.eplb.transfer import Move, plan_moves


def test_unchanged_slots_stay_and_local_copies_come_first() -> None:
    old = [0, 1, 2, 3]
    new = [1, 0, 2, 2]  # rank 0 swaps its two experts; rank 1 replaces 3 by a second 2
    assert plan_moves(old, new, 2) == [Move(0, 1), Move(1, 0), Move(2, 2), Move(3, 2)]


def test_remote_experts_spread_over_their_holders() -> None:
    old = [0, 0, 1, 2, 3, 4]  # expert 0 on slots 0 and 1 (rank 0)
    new = [1, 2, 3, 4, 0, 0]  # rank 2 needs expert 0 twice, rank 0 needs 1 and 2
    moves = plan_moves(old, new, 3)
    assert moves == [Move(0, 2), Move(1, 3), Move(2, 4), Move(3, 5), Move(4, 0), Move(5, 1)]


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ValueError, match="no slot in the old placement"):
        plan_moves([0, 1], [0, 2], 1)
    with pytest.raises(ValueError, match="over 3 ranks"):
        plan_moves([0, 1], [1, 0], 3)


def test_a_growing_placement_takes_redundant_slots_from_holders() -> None:
    # 4 experts on 2 ranks grow to 6 slots: rank 0 gets a second copy of 0, rank 1 of 0 too
    moves = plan_moves([0, 1, 2, 3], [0, 1, 0, 2, 3, 0], 2)
    assert moves == [Move(0, 0), Move(1, 1), Move(2, 0), Move(3, 2), Move(4, 3), Move(5, 0)]
