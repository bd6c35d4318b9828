"""Groups on one node get shared-memory collectives that give gloo's exact bits (2 members),
carry objects in rounds, and can be turned off (``DSV4_SHM_COMM=0``); nothing stays in
/dev/shm."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import run_ranks
from .shm_cases import shm_groups

pytestmark = pytest.mark.dist


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("dsv4-comm-*")}


def test_tp2_dp2_groups_use_shm_with_gloo_bits_and_leave_no_segment() -> None:
    before = _segments()
    results = run_ranks(shm_groups, world=4, timeout=90, args=(False,))
    for rank, r in enumerate(results):
        assert r.pop("broadcast") == {"from": rank // 2 * 2 + 1}
        assert r == {
            "tp": True,
            "dp": True,
            "ep": True,
            "objects": True,
            "all_reduce_small": True,
            "all_gather_small": True,
            "all_reduce_rounds": True,
            "all_gather_rounds": True,
        }
    assert _segments() == before


def test_shm_off_keeps_gloo() -> None:
    r0, r1 = run_ranks(shm_groups, world=2, timeout=60, args=(True,))
    assert r0 == r1 == {"tp": False, "ep": False, "objects": True, "broadcast": {"from": 1}}
