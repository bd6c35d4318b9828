"""CPU instances with tp/dp: each pod runs tp*dp/nodesPerInstance rank processes, each with its
share of the engine container's CPUs; a multi-node CPU instance renders leader and followers."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_operator.api.spec import RoleSpec, parse
from dsv4_operator.reconcile import Facts, desired_children
from dsv4_operator.reconcile.cpu_ranks import container_cpus, rank_threads
from dsv4_operator.reconcile.engine_pod import engine_command

from .conftest import make_cr

pytestmark = pytest.mark.unit


def _cpu(**role: Any) -> dict[str, Any]:
    return make_cr(
        model={"preset": "dsv4-tiny", "servedName": "tiny"},
        prefill={"npusPerNode": 0, "parallelism": {"tp": 1}, **role},
        decode={"npusPerNode": 0, "parallelism": {"tp": 1}},
        kvTransfer={"transport": "tcp"},
    )


def _prefill(**role: Any) -> RoleSpec:
    return parse(_cpu(**role)).prefill


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize(
    ("role", "ranks", "threads"),
    [
        ({"parallelism": {"tp": 2}, "resources": {"limits": {"cpu": "2"}}}, 2, 1),
        ({"parallelism": {"tp": 2}, "resources": {"limits": {"cpu": "5"}}}, 2, 2),
        # the limit is the hard cap: it wins over the request
        (
            {
                "parallelism": {"tp": 2, "dp": 2},
                "resources": {"requests": {"cpu": "16"}, "limits": {"cpu": "8"}},
            },
            4,
            2,
        ),
        ({"parallelism": {"tp": 2}, "resources": {"requests": {"cpu": "500m"}}}, 2, 1),
        ({"parallelism": {"tp": 1}, "resources": {"requests": {"cpu": "1500m"}}}, 1, 1),
        ({"parallelism": {"tp": 1}, "resources": {"requests": {"cpu": 3}}}, 1, 3),
        # 4 ranks over 2 pods: 2 per pod share each pod's 6 CPUs
        (
            {
                "nodesPerInstance": 2,
                "parallelism": {"tp": 2, "dp": 2},
                "resources": {"limits": {"cpu": "6"}},
            },
            2,
            3,
        ),
        # no CPU named: the engine's own default (the CPUs it sees, split over its ranks)
        ({"parallelism": {"tp": 2}}, 2, 0),
    ],
)
def test_each_rank_gets_its_share_of_the_pods_cpus(
    role: dict[str, Any], ranks: int, threads: int
) -> None:
    spec = _prefill(**role)
    assert spec.ranks_per_node == ranks
    assert rank_threads(spec) == threads
    assert _flag(engine_command(spec), "--threads-per-rank") == str(threads)


def test_container_cpus_reads_the_limit_then_the_request() -> None:
    assert container_cpus({}) is None
    assert container_cpus({"requests": {"memory": "1Gi"}}) is None
    assert str(container_cpus({"requests": {"cpu": "250m"}})) == "0.250"
    assert container_cpus({"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}) == 2


def test_npu_pods_get_no_thread_flag() -> None:
    npu = parse(make_cr()).prefill
    assert npu.ranks_per_node == 8
    assert "--threads-per-rank" not in engine_command(npu)


def test_a_two_node_cpu_instance_renders_a_leader_and_a_follower() -> None:
    spec = parse(_cpu(nodesPerInstance=2, parallelism={"tp": 2, "dp": 2}))
    sts = next(
        o
        for o in desired_children(spec, Facts(kv_token="t"))
        if o["metadata"]["name"] == "v4-prefill-0"
    )
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    cmd = engine["command"]
    assert (_flag(cmd, "--tensor-parallel-size"), _flag(cmd, "--data-parallel-size")) == ("2", "2")
    assert _flag(cmd, "--expert-parallel-size") == "4"
    assert _flag(cmd, "--device") == "cpu" and "--rank-table" not in cmd
    # the two pods may start minutes apart: the ranks wait as long as the startup probe
    assert _flag(cmd, "--rendezvous-timeout") == "1800"
    assert "--rendezvous-timeout" not in engine_command(_prefill(parallelism={"tp": 2}))
    env = {e["name"]: e for e in engine["env"]}
    assert env["DSV4_NODES_PER_INSTANCE"]["value"] == "2"
    assert env["DSV4_MASTER_ADDR"]["value"] == "v4-prefill-0-0.v4-prefill"
    assert "pod-index" in env["DSV4_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    # the role's Service publishes the leader before it is ready: the followers must find it
    svc = next(
        o
        for o in desired_children(spec, Facts(kv_token="t"))
        if o["kind"] == "Service" and o["metadata"]["name"] == "v4-prefill"
    )
    assert svc["spec"]["publishNotReadyAddresses"] is True
