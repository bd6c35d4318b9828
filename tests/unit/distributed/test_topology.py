from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsv4_serving.distributed.topology import Topology, TopologyError
from dsv4_serving.models.config import DeepseekV3Config, DeepseekV4Config
from dsv4_serving.presets.configs import preset_config


def test_tp2_dp2_groups_are_contiguous_for_tp_and_strided_for_dp() -> None:
    t = Topology(tp=2, dp=2, ep=4)
    assert t.world == 4
    assert t.tp_groups() == [[0, 1], [2, 3]]
    assert t.dp_groups() == [[0, 2], [1, 3]]
    assert t.ep_groups() == [[0, 1, 2, 3]]
    assert [(t.dp_rank(r), t.tp_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert t.rank(dp_rank=1, tp_rank=0) == 2


def test_two_nodes_of_tp8_put_one_tp_group_on_each_node() -> None:
    t = Topology(tp=8, dp=2, ep=16, nnodes=2)
    assert t.ranks_per_node == 8
    assert t.node_ranks(1) == list(range(8, 16))
    assert t.tp_groups() == [list(range(8)), list(range(8, 16))]
    assert [t.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert [t.local_rank(r) for r in (0, 7, 8, 15)] == [0, 7, 0, 7]
    assert t.dp_groups()[3] == [3, 11]


def test_decode_tp4_dp2_without_ep_has_one_rank_ep_groups() -> None:
    t = Topology(tp=4, dp=2)
    assert t.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.ep_groups() == [[r] for r in range(8)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 2, "dp": 2, "ep": 2}, "expert parallel size 2 must be 1 or tp x dp = 4: EP spans"),
        ({"tp": 0}, "tp must be >= 1, got 0"),
        ({"tp": 2, "dp": 3, "nnodes": 4}, "world size 6 (tp 2 x dp 3) does not split evenly"),
    ],
)
def test_invalid_sizes_are_refused_with_the_reason(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(TopologyError) as err:
        Topology(**kwargs)
    assert message in str(err.value)


def test_more_ranks_per_node_than_devices_is_refused() -> None:
    with pytest.raises(TopologyError, match="8 ranks per node but only 4 visible devices"):
        Topology(tp=8).check_local_devices(4)


def _v4(**over: int) -> DeepseekV4Config:
    return DeepseekV4Config.from_dict({**preset_config("dsv4-tiny"), **over})


@pytest.mark.parametrize(
    ("cfg", "topo", "message"),
    [
        (_v4(), Topology(tp=4), "output groups (o_groups) 2 is not divisible by tp 4"),
        (_v4(num_attention_heads=6, o_groups=6), Topology(tp=4), "attention heads 6 is not"),
        (_v4(vocab_size=263), Topology(tp=2), "vocab size 263 is not divisible by tp 2"),
        (
            _v4(n_routed_experts=9),
            Topology(tp=2, ep=2),
            "routed experts 9 is not divisible by ep 2",
        ),
        (_v4(moe_intermediate_size=63), Topology(tp=2), "moe_intermediate_size 63 is not"),
    ],
)
def test_model_dimensions_must_split(cfg: object, topo: Topology, message: str) -> None:
    with pytest.raises(TopologyError) as err:
        topo.check_model(cfg)
    assert message in str(err.value)


def test_v3_dense_intermediate_must_split_over_tp() -> None:
    cfg = DeepseekV3Config.from_dict({**preset_config("dsv3-small"), "intermediate_size": 510})
    Topology(tp=2).check_model(DeepseekV3Config.from_dict(preset_config("dsv3-small")))
    with pytest.raises(TopologyError, match="dense intermediate_size 510 is not divisible by tp 4"):
        Topology(tp=4).check_model(cfg)


def test_presets_split_as_the_dist_tier_runs_them() -> None:
    v4 = _v4()
    for topo in (Topology(tp=2), Topology(tp=2, ep=2), Topology(dp=2, ep=2), Topology(2, 2, 4)):
        topo.check_model(v4)
    Topology(tp=4, ep=4).check_model(SimpleNamespace(**preset_config("dsv3-small")))


def test_tp2_cp2_dp2_orders_ranks_tp_fastest_then_cp_then_dp() -> None:
    t = Topology(tp=2, dp=2, cp=2)
    assert t.world == 8
    assert t.shape == "tp 2 x cp 2 x dp 2"
    assert [(t.dp_rank(r), t.cp_rank(r), t.tp_rank(r)) for r in (0, 1, 2, 3, 5, 6)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 1),
        (1, 1, 0),
    ]
    assert t.rank(dp_rank=1, tp_rank=1, cp_rank=1) == 7
    assert t.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.step_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_cp_alone_and_cp1_keep_the_tp_dp_layout() -> None:
    assert Topology(cp=2).cp_groups() == [[0, 1]]
    assert Topology(cp=2).tp_groups() == [[0], [1]]
    assert Topology(tp=2, dp=2).cp_groups() == [[0], [1], [2], [3]]
    assert Topology(tp=2, dp=2).step_groups() == Topology(tp=2, dp=2).tp_groups()


def test_cp_with_ep_is_refused_naming_both_flags() -> None:
    with pytest.raises(TopologyError, match=r"--expert-parallel-size.*--context-parallel-size"):
        Topology(tp=1, cp=2, ep=2)
