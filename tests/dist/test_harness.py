"""The harness itself: results by rank, and a failing rank ends the run with every traceback
while the rank left waiting for it is killed (not waited on until its own timeout)."""

from __future__ import annotations

import time

import pytest

from .cases import one_rank_fails, sizes_of_the_world
from .harness import GRACE_S, run_ranks

pytestmark = pytest.mark.dist


def test_results_come_back_in_rank_order() -> None:
    assert run_ranks(sizes_of_the_world, world=3, timeout=60) == [(0, 3), (1, 3), (2, 3)]


def test_a_failing_rank_fails_the_run_and_its_waiting_peer_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_ranks(one_rank_fails, world=2, timeout=90)
    assert time.monotonic() - start < GRACE_S + 20  # far below rank 0's 60 s rendezvous
    msg = str(err.value)
    assert "--- rank 1 ---" in msg and "ValueError: boom on rank 1" in msg
    assert "--- rank 0 ---\nno result (exit code" in msg
