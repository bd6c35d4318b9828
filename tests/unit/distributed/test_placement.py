"""Where a ``dsv4 engine`` process's ranks sit: flags over the operator's environment over
the one-node defaults, and readable refusals."""

from __future__ import annotations

import argparse

import pytest

from dsv4_serving.distributed.placement import (
    DEFAULT_MASTER_PORT,
    Placement,
    PlacementError,
)
from dsv4_serving.distributed.topology import Topology
from dsv4_serving.entrypoints import cli

pytestmark = pytest.mark.unit

FOLLOWER_ENV = {
    "DSV4_NODE_RANK": "1",
    "DSV4_NODES_PER_INSTANCE": "2",
    "DSV4_MASTER_ADDR": "v4-prefill-0-0.v4-prefill",
}


def test_defaults_are_one_node_with_a_free_port() -> None:
    assert Placement.resolve({}) == Placement(1, 0, "127.0.0.1", 0)
    assert not Placement.resolve({}).headless


def test_the_operators_environment_makes_a_headless_follower() -> None:
    p = Placement.resolve(FOLLOWER_ENV)
    assert p == Placement(2, 1, "v4-prefill-0-0.v4-prefill", DEFAULT_MASTER_PORT)
    assert p.headless
    assert p.ranks(Topology(tp=2, dp=2, ep=4, nnodes=2)) == [2, 3]


def test_a_one_node_instance_rendezvous_in_its_own_pod() -> None:
    """The operator sets DSV4_MASTER_ADDR for every instance; for a one-node one (tp 2 in one
    pod) that name is the pod's own and does not resolve before the pod is Ready (the real-node
    tier caught it): the ranks meet on 127.0.0.1. A flag still wins."""
    env = {"DSV4_NODE_RANK": "0", "DSV4_NODES_PER_INSTANCE": "1"}
    env["DSV4_MASTER_ADDR"] = "v4-prefill-0-0.v4-prefill"
    assert Placement.resolve(env) == Placement(1, 0, "127.0.0.1", 0)
    assert Placement.resolve(env, master_addr="10.0.0.5").master_addr == "10.0.0.5"


def test_flags_win_over_the_environment() -> None:
    p = Placement.resolve(FOLLOWER_ENV, node_rank=0, master_addr="10.0.0.5", master_port=1234)
    assert p == Placement(2, 0, "10.0.0.5", 1234)
    env = {**FOLLOWER_ENV, "DSV4_MASTER_PORT": "4321"}
    assert Placement.resolve(env).master_port == 4321


@pytest.mark.parametrize(
    ("env", "kw", "message"),
    [
        ({"DSV4_NODE_RANK": "x"}, {}, "DSV4_NODE_RANK='x' is not an integer"),
        (FOLLOWER_ENV, {"node_rank": 2}, "--node-rank 2 is outside the instance's 2 node"),
        ({}, {"nnodes": 0}, "--nnodes must be >= 1"),
        ({}, {"nnodes": 2, "master_port": 0}, "needs --master-port"),
    ],
)
def test_bad_placements_name_the_setting(
    env: dict[str, str], kw: dict[str, int], message: str
) -> None:
    with pytest.raises(PlacementError, match=message.replace("(", "\\(")):
        Placement.resolve(env, **kw)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_headless_on_node_0_is_refused_and_a_world_that_does_not_split_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for k in FOLLOWER_ENV:
        monkeypatch.delenv(k, raising=False)
    assert cli.run(_args("--model", "dsv4-tiny", "--headless")) == 2
    assert (
        "--headless runs the ranks of a node rank > 0, and this is node 0"
        in capsys.readouterr().err
    )
    args = _args("--model", "dsv4-tiny", "--tensor-parallel-size", "3", "--nnodes", "2")
    assert cli.run(args) == 2
    assert "does not split evenly over 2 nodes" in capsys.readouterr().err
