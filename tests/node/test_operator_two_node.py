"""A 2-node CPU instance on real pods: decode `nodesPerInstance: 2`, `tp: 2` (one rank per pod),
prefill `tp: 2` (two ranks in one pod), as docs/parallelism.md declares it. The follower pod finds
its leader by the DNS name the operator gives it (DSV4_MASTER_ADDR, through CoreDNS and the
role's headless Service), the tensor-parallel group forms across the two pods (gloo between
their network namespaces), and a completion through the gateway's Service gives the greedy
tokens of the single-pod tiny example (test_operator_e2e.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.node.conftest import RealClusterHandle, deployment
from tests.node.test_operator_e2e import gateway_url, greedy_completion, tiny_on_real_node

NS = "dsv4-duo"


def duo_on_real_node(images: dict[str, str]) -> dict[str, Any]:
    cr = tiny_on_real_node(images, NS)
    cr["metadata"]["name"] = "duo"
    spec = cr["spec"]
    spec["prefill"]["parallelism"] = {"tp": 2}
    spec["prefill"]["resources"]["limits"] = {"cpu": "2"}  # two ranks: --threads-per-rank 1
    spec["decode"]["parallelism"] = {"tp": 2}
    spec["decode"]["nodesPerInstance"] = 2
    spec["decode"]["resources"]["limits"] = {"cpu": "1"}
    return cr


@pytest.fixture(scope="module")
def duo(
    real_cluster: Any,
    real_handle: RealClusterHandle,
    app_images: dict[str, str],
    chart_operator: None,
) -> Iterator[Any]:
    t0 = time.monotonic()
    with deployment(real_cluster, duo_on_real_node(app_images)):
        real_handle.timings["2-node duo Ready after apply"] = time.monotonic() - t0
        yield real_cluster


def _decode_pods(cluster: Any) -> list[dict[str, Any]]:
    pods = json.loads(
        cluster.kubectl("get", "pods", "-n", NS, "-l", "serving.dsv4.io/role=decode", "-o", "json")
    )["items"]
    return sorted(pods, key=lambda p: p["metadata"]["name"])


def _env(pod: dict[str, Any]) -> dict[str, str]:
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    return {e["name"]: e.get("value", "") for e in engine.get("env", [])}


def test_a_two_node_instance_serves_the_single_pod_tokens(
    duo: Any, real_handle: RealClusterHandle
) -> None:
    leader, follower = _decode_pods(duo)
    sts = json.loads(
        duo.kubectl(
            "get", "statefulsets", "-n", NS, "-l", "serving.dsv4.io/role=decode", "-o", "json"
        )
    )["items"][0]
    leader_dns = f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    assert _env(follower)["DSV4_MASTER_ADDR"] == leader_dns
    assert _env(follower)["DSV4_NODES_PER_INSTANCE"] == "2"
    # the follower runs headless: it joined the leader's group (its ranks are alive) and serves
    # no API of its own
    script = (
        "import urllib.request, urllib.error\n"
        "print(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5).status)\n"
        "try: urllib.request.urlopen('http://127.0.0.1:8000/v1/models', timeout=5)\n"
        "except urllib.error.HTTPError as e: print(e.code)"
    )
    out = duo.kubectl(
        "exec", "-n", NS, follower["metadata"]["name"], "-c", "engine", "--", "python", "-c", script
    ).split()
    assert out == ["200", "404"], out
    for pod in (leader, follower):
        statuses = pod["status"]["containerStatuses"]
        assert all(s["ready"] and s["restartCount"] == 0 for s in statuses), statuses
    out = greedy_completion(gateway_url(duo, NS, "duo"))
    assert out.usage is not None and out.usage.completion_tokens == 16
    single = real_handle.notes.get("tiny greedy text")
    if single is None:
        pytest.skip("the single-pod oracle did not run (test_operator_e2e.py)")
    assert out.choices[0].text == single[0]
