"""The operator under bad specs and a dying API server, on the real control plane."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dsv4_operator.api.spec import parse
from dsv4_operator.reconcile.network import role_service
from tests.helpers import wait_for
from tests.k8s.operator_fixtures import apply_yaml, kubectl_json, warning_events
from tests.k8s.test_operator import _children, _phase_is, _status


def _cpu_cr(name: str, **spec: Any) -> dict[str, Any]:
    """The tiny CPU deployment (its pods run on the kwok nodes) with ``spec`` added."""
    cpu = {"npusPerNode": 0, "parallelism": {"tp": 1}}
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DeepSeekV4Deployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"preset": "dsv4-tiny", "servedName": "tiny"},
            "prefill": cpu,
            "decode": cpu,
            "kvTransfer": {"transport": "tcp"},
            **spec,
        },
    }


def test_a_child_the_api_server_refuses_applies_nothing_and_names_the_field(
    k8s_cluster, operator, namespace
) -> None:
    cluster, ns = k8s_cluster, namespace
    # the CRD keeps tolerations opaque (a core type): the API server judges them in the child
    bad = _cpu_cr("bad", scheduling={"tolerations": [{"key": "a", "operator": "Bogus"}]})
    apply_yaml(cluster, json.dumps(bad), ns)
    st = wait_for("phase Degraded", lambda: _phase_is(cluster, ns, "bad", "Degraded"))
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ChildRejected"
    assert degraded["message"].startswith(
        'spec.scheduling.tolerations[0].operator: Unsupported value: "Bogus"'
    ), degraded["message"]
    assert not _children(cluster, ns, "bad")  # not a ConfigMap, Secret or Service
    assert any(
        "spec.scheduling.tolerations[0]" in e["message"] for e in warning_events(cluster, ns, "bad")
    )

    cluster.kubectl(
        "patch",
        "dsv4",
        "bad",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"scheduling": {"tolerations": [{"key": "a", "operator": "Exists"}]}}}),
    )
    wait_for("Ready once fixed", lambda: _phase_is(cluster, ns, "bad", "Ready"), timeout_s=120)
    assert "StatefulSet/bad-prefill-0" in _children(cluster, ns, "bad")
    degraded = next(c for c in _status(cluster, ns, "bad")["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"


def test_a_node_path_model_is_refused_unless_the_chart_allows_it(
    k8s_cluster, operator, namespace
) -> None:
    cluster, ns = k8s_cluster, namespace
    cr = _cpu_cr("hostpath", model={"path": "/data/v4", "servedName": "v4"})
    apply_yaml(cluster, json.dumps(cr), ns)
    st = wait_for("phase Degraded", lambda: _phase_is(cluster, ns, "hostpath", "Degraded"))
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "--set hostAccess.modelPath=true" in degraded["message"]
    assert not _children(cluster, ns, "hostpath")


def _endpoint(cluster: Any, ns: str, service: str, ip: str) -> dict[str, Any] | None:
    slices = kubectl_json(
        cluster, "get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={service}"
    )["items"]
    for s in slices:
        for ep in s.get("endpoints") or []:
            if ip in ep["addresses"]:
                return dict(ep["conditions"])
    return None


@pytest.mark.parametrize("nodes", [1, 2])
def test_role_endpoints_say_serving_and_terminating(k8s_cluster, namespace, nodes: int) -> None:
    """What the gateway routes by: ``serving`` follows the pod's readiness and ``terminating``
    its deletion, whether or not the Service publishes not-ready addresses (multi-node only)."""
    cluster, ns = k8s_cluster, namespace
    cr = _cpu_cr("eps", prefill={"nodesPerInstance": nodes, "parallelism": {"tp": 1, "dp": nodes}})
    cr["metadata"].update(namespace=ns, uid="u")
    spec = parse(cr)
    service = role_service(spec, "prefill")
    del service["metadata"]["ownerReferences"]
    assert service["spec"]["publishNotReadyAddresses"] is (nodes > 1)
    apply_yaml(cluster, json.dumps(service), ns)
    # a pod on a node no kubelet (nor kwok) runs: nothing but this test writes its status
    node = f"still-{ns}"
    node_obj = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(node_obj))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "eps-prefill-0-0",
            "labels": service["spec"]["selector"],
            "finalizers": ["test.dsv4.io/hold"],
        },
        "spec": {"nodeName": node, "containers": [{"name": "engine", "image": "x"}]},
    }
    apply_yaml(cluster, json.dumps(pod), ns)

    def status(ready: bool) -> None:
        cluster.kubectl(
            "patch",
            "pod",
            "eps-prefill-0-0",
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(
                {
                    "status": {
                        "phase": "Running",
                        "podIP": "10.9.9.9",
                        "podIPs": [{"ip": "10.9.9.9"}],
                        "conditions": [{"type": "Ready", "status": str(ready)}],
                    }
                }
            ),
        )

    def conditions(want: dict[str, bool]) -> dict[str, Any] | None:
        got = _endpoint(cluster, ns, "eps-prefill", "10.9.9.9")
        return got if got is not None and all(got.get(k) is v for k, v in want.items()) else None

    try:
        status(ready=False)
        got = wait_for("a not-ready endpoint", lambda: conditions({"serving": False}))
        # published for a multi-node rendezvous, ``ready`` says nothing: the gateway reads serving
        assert got["ready"] is (nodes > 1)
        status(ready=True)
        wait_for("a serving endpoint", lambda: conditions({"serving": True, "ready": True}))
        cluster.kubectl("delete", "pod", "eps-prefill-0-0", "-n", ns, "--wait=false")
        wait_for("a terminating endpoint", lambda: conditions({"terminating": True}))
    finally:
        cluster.kubectl(
            "patch",
            "pod",
            "eps-prefill-0-0",
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
        )
        cluster.kubectl("delete", "node", node, "--wait=false")
