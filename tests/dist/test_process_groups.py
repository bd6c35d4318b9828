"""Collectives, the config fingerprint and rendezvous failures give exact, readable results."""

from __future__ import annotations

import pytest

from dsv4_common.process import free_port
from dsv4_serving.distributed.parallel_state import RendezvousError, init_distributed
from dsv4_serving.distributed.topology import Topology
from dsv4_serving.platform.device import PlatformError

from .cases import all_to_all, collectives, fingerprint_mismatch, world_mismatch
from .harness import run_ranks

pytestmark = pytest.mark.dist


def test_collectives_on_two_ranks_give_exact_results() -> None:
    r0, r1 = run_ranks(collectives, world=2, timeout=60)
    assert r0["all_reduce"] == r1["all_reduce"] == [10.0, 12.0, 14.0]
    assert r0["all_gather"] == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
    assert r0["sizes"] == r1["sizes"] == [1, 2]
    assert r1["all_gatherv"] == [0.0, 1.0, 1.0]
    # the gathered rows summed over both ranks (x2), this rank's share of them
    assert r0["reduce_scatterv"] == [0.0]
    assert r1["reduce_scatterv"] == [2.0, 2.0]
    assert r0["broadcast"] == r1["broadcast"] == {"from": 0}
    assert r0["gather"] == [0, 10] and r1["gather"] is None


def test_a_rank_with_another_config_is_named_by_every_rank() -> None:
    messages = run_ranks(fingerprint_mismatch, world=2, timeout=60)
    assert messages == ["rank 1 disagrees with rank 0 on dp: 2 vs 1"] * 2


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo-native"])
def test_all_to_allv_with_uneven_splits_gives_each_member_its_rows(shm: bool) -> None:
    r0, r1 = run_ranks(all_to_all, world=2, timeout=60, args=(shm,))
    assert r0["shm"] == r1["shm"] == shm
    # member 0 gets its own 1 row then member 1's 3; member 1 gets member 0's 2 and none
    assert r0["rows"] == [0.0, 100.0, 101.0, 102.0]
    assert r1["rows"] == [10.0, 11.0]
    assert r0["equal_cols"] and r1["equal_cols"]


def test_a_node_with_another_world_size_is_named_by_every_rank() -> None:
    messages = run_ranks(world_mismatch, world=2, timeout=60)
    want = (
        "rank 1 (node 0) runs world 4 (tp 2 x dp 2 over 2 node(s)) but rank 0 runs world 2 "
        "(tp 2 x dp 1 over 2 node(s)); every node of an instance needs the same"
    )
    assert all(want in m for m in messages), messages


def test_rendezvous_timeout_names_the_ranks_that_never_joined() -> None:
    with pytest.raises(RendezvousError) as err:
        init_distributed(
            Topology(tp=2, dp=2, nnodes=2),
            0,
            master_addr="127.0.0.1",
            master_port=free_port(),
            timeout_s=600.0,  # the collectives' timeout: the rendezvous has its own
            rendezvous_timeout_s=1.0,
        )
    assert "timed out after 1 s: ranks 1, 2, 3 (node 0, 1) of world 4 (tp 2 x dp 2 over 2" in str(
        err.value
    )


def test_a_follower_without_its_master_says_so() -> None:
    with pytest.raises(RendezvousError, match="rank 1 could not reach the rendezvous master at"):
        init_distributed(
            Topology(dp=2), 1, master_addr="127.0.0.1", master_port=free_port(), timeout_s=1.0
        )


def test_an_accelerator_backend_without_the_hardware_fails_before_rendezvous() -> None:
    with pytest.raises(PlatformError, match="device 'npu' requested but torch_npu"):
        init_distributed(Topology(tp=2), 0, master_addr="127.0.0.1", master_port=1, device="npu")
