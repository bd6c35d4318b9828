"""The placement policies: the published example, and the invariants on random skewed loads."""

from __future__ import annotations

import random

import pytest

from dsv4_serving.eplb.algorithm import (
    PlacementError,
    imbalance,
    initial_placement,
    layers_worth_moving,
    pack,
    rank_loads,
    rebalance,
    replicate,
)

README_LOAD = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]


def test_reproduces_deepseeks_published_example() -> None:
    # deepseek-ai/EPLB README: 2 layers x 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs
    p = rebalance(README_LOAD, slots=16, groups=4, nodes=2, ranks=8)
    assert p.phys_to_log == (
        (5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1),
        (7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1),
    )
    assert p.counts[0] == (1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1)
    l2p = p.log_to_phys(0)
    assert l2p[5] == (0, 2) and l2p[1] == (15, 13)  # replica order
    assert [p.replica[0][s] for s in l2p[5]] == [0, 1]


def test_hierarchical_keeps_each_group_on_one_node() -> None:
    p = rebalance(README_LOAD, slots=16, groups=4, nodes=2, ranks=8)
    for row in p.phys_to_log:
        for node in range(2):
            groups = {e // 3 for e in row[node * 8 : (node + 1) * 8]}
            assert len(groups) == 2


def test_global_policy_when_groups_do_not_divide_over_nodes() -> None:
    p = rebalance(README_LOAD, slots=16, groups=3, nodes=2, ranks=8)
    assert p.phys_to_log == rebalance(README_LOAD, slots=16, groups=1, nodes=1, ranks=8).phys_to_log


def test_pack_and_replicate_exact() -> None:
    assert pack([5.0, 1.0, 4.0, 2.0], 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert pack([1.0, 1.0, 1.0, 1.0], 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    expert, rank, count = replicate([10.0, 3.0, 6.0], 5)
    assert expert == [0, 1, 2, 0, 2]  # 10 -> 5 per replica, then 6 beats 5
    assert rank == [0, 0, 0, 1, 1]
    assert count == [2, 1, 2]


@pytest.mark.parametrize(
    ("experts", "slots", "groups", "nodes", "ranks"),
    [(16, 20, 4, 2, 4), (32, 40, 8, 1, 4), (64, 64, 8, 2, 8), (12, 16, 3, 2, 8), (8, 10, 1, 1, 2)],
)
def test_invariants_on_random_skewed_loads(
    experts: int, slots: int, groups: int, nodes: int, ranks: int
) -> None:
    rng = random.Random(experts * 1000 + slots)
    for _ in range(20):
        load = [[rng.paretovariate(1.2) * 100 for _ in range(experts)] for _ in range(3)]
        p = rebalance(load, slots, groups, nodes, ranks)
        identity = [
            [
                float(sum(row[r * experts // ranks : (r + 1) * experts // ranks]))
                for r in range(ranks)
            ]
            for row in load
        ]
        after = rank_loads(p, load, ranks)
        for layer, row in enumerate(p.phys_to_log):
            assert len(row) == slots  # equal slots per rank: slots / ranks each
            assert all(c >= 1 for c in p.counts[layer])  # every logical expert has a replica
            assert sorted(set(row)) == list(range(experts))
            for e, phys in enumerate(p.log_to_phys(layer)):
                assert sorted(p.replica[layer][s] for s in phys) == list(range(len(phys)))
                assert all(row[s] == e for s in phys)
            assert sum(after[layer]) == pytest.approx(sum(load[layer]))
            assert max(after[layer]) <= max(identity[layer]) + 1e-9


def test_skew_of_two_or_more_is_brought_to_at_most_1_2() -> None:
    # the hot experts all sit on rank 0 of 4 in the identity placement
    load = [[80.0, 60.0, 40.0, 20.0] + [2.0] * 12]
    before = imbalance([sum(load[0][r * 4 : (r + 1) * 4]) for r in range(4)])
    p = rebalance(load, slots=20, groups=1, nodes=1, ranks=4)
    after = imbalance(rank_loads(p, load, 4)[0])
    assert before == pytest.approx(200 / 56)
    assert after <= 1.2


@pytest.mark.parametrize(
    ("slots", "groups", "nodes", "ranks", "match"),
    [
        (10, 4, 2, 8, "slots over 8 ranks"),
        (16, 5, 1, 8, "do not split into 5 groups"),
        (8, 1, 1, 8, "cannot hold 12 experts"),
        (16, 4, 2, 3, "slots over 3 ranks"),
    ],
)
def test_shapes_that_cannot_be_placed_are_refused(
    slots: int, groups: int, nodes: int, ranks: int, match: str
) -> None:
    with pytest.raises(PlacementError, match=match):
        rebalance(README_LOAD, slots, groups, nodes, ranks)


def test_idle_layer_has_no_imbalance() -> None:
    assert imbalance([0.0, 0.0]) == 1.0
    assert imbalance([3.0, 1.0]) == 1.5


def test_the_initial_placement_is_the_plain_ep_layout_plus_replicas() -> None:
    assert initial_placement(8, 8) == tuple(range(8))
    assert initial_placement(8, 10) == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
    with pytest.raises(PlacementError, match="cannot hold"):
        initial_placement(8, 6)


def test_a_balanced_layer_is_not_moved_again_when_the_load_drifts() -> None:
    """A stationary skewed load: the first plan moves the layer, plans from later windows (the
    same load with 1% noise) reshuffle it without a real gain and leave it where it is."""
    rng = random.Random(5)
    experts, slots, ranks = 12, 16, 4
    base = [1000.0 / (e + 1) ** 1.2 for e in range(experts)]
    identity = [initial_placement(experts, slots)]
    load = [base]
    first = rebalance(load, slots, 1, 1, ranks)
    assert layers_worth_moving(identity, first, load, ranks) == [0]
    current = first.phys_to_log
    for _ in range(3):
        drift = [[v * (1 + rng.uniform(-0.01, 0.01)) for v in base]]
        plan = rebalance(drift, slots, 1, 1, ranks)
        assert layers_worth_moving(current, plan, drift, ranks) == []
    # a real change of load still moves it
    flipped = [list(reversed(base))]
    assert layers_worth_moving(current, rebalance(flipped, slots, 1, 1, ranks), flipped, ranks) == [
        0
    ]
