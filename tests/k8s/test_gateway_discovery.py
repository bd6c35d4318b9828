"""The gateway discovers engines from EndpointSlices on the real control plane, with exactly the
RBAC the operator gives each gateway."""

from __future__ import annotations

import json
from typing import Any

import httpx

from dsv4_operator.api.spec import parse
from dsv4_operator.reconcile.gateway import gateway_objects
from tests.gateway.conftest import gateway
from tests.helpers import wait_for


def _slice(name: str, role: str, endpoints: list[tuple[str, str, bool]]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/service-name": f"demo-{role}",
                "app.kubernetes.io/instance": "demo",
                "serving.dsv4.io/role": role,
            },
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8000, "protocol": "TCP"},
            {"name": "kv", "port": 14579, "protocol": "TCP"},
        ],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod},
            }
            for ip, pod, ready in endpoints
        ],
    }


def _members(url: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for inst in httpx.get(f"{url}/instances", timeout=5).json():
        out.setdefault(inst["role"], set()).add(inst["url"])
    return out


def test_gateway_watches_endpointslices(k8s_control_plane, namespace) -> None:
    cluster, ns = k8s_control_plane, namespace
    cr = {
        "metadata": {"name": "demo", "namespace": ns, "uid": "u"},
        "spec": {"model": {"path": "/m", "servedName": "m"}},
    }
    for obj in gateway_objects(parse(cr)):
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            obj["metadata"].pop("ownerReferences")
            cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    kubeconfig = cluster.service_account_kubeconfig(ns, "demo-gateway")

    def apply(obj: dict[str, Any]) -> None:
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))

    apply(
        _slice(
            "demo-prefill-a",
            "prefill",
            [("10.1.0.1", "demo-prefill-0-0", True), ("10.1.0.2", "demo-prefill-0-1", True)],
        )
    )
    g = gateway(
        "gateway-k8s",
        "--discovery",
        "kubernetes",
        "--kubeconfig",
        str(kubeconfig),
        "--namespace",
        ns,
        "--selector",
        "app.kubernetes.io/instance=demo",
        "--routing-configmap",
        "demo-routing",
    )
    g.start(env={"PYTHONUNBUFFERED": "1"})
    try:
        # /health says unavailable until both roles have healthy engines; wait for the server itself
        wait_for(
            "the gateway to serve",
            lambda: _try(lambda: httpx.get(f"{g.url}/instances", timeout=2).status_code == 200),
        )
        # node rank 1 of an instance is not an API endpoint
        wait_for(
            "the prefill leader", lambda: _members(g.url).get("prefill") == {"http://10.1.0.1:8000"}
        )
        apply(
            _slice(
                "demo-decode-a",
                "decode",
                [("10.2.0.1", "demo-decode-0-0", True), ("10.2.0.2", "demo-decode-1-0", False)],
            )
        )
        wait_for(
            "the ready decode engine",
            lambda: _members(g.url).get("decode") == {"http://10.2.0.1:8000"},
        )
        apply(
            _slice(
                "demo-decode-a",
                "decode",
                [("10.2.0.1", "demo-decode-0-0", True), ("10.2.0.2", "demo-decode-1-0", True)],
            )
        )
        wait_for("the second decode engine", lambda: len(_members(g.url).get("decode", ())) == 2)
        # the autoscaler drains decode instance 1: no new requests to it, the other stays
        routing = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "demo-routing"},
            "data": {"routing.json": json.dumps({"draining": ["demo-decode-1"]})},
        }
        apply(routing)
        wait_for(
            "the draining instance to leave the routing",
            lambda: _members(g.url).get("decode") == {"http://10.2.0.1:8000"},
        )
        routing["data"] = {"routing.json": json.dumps({"draining": []})}
        apply(routing)
        wait_for("the drain to be lifted", lambda: len(_members(g.url).get("decode", ())) == 2)
        cluster.kubectl("delete", "endpointslice", "demo-prefill-a", "-n", ns)
        wait_for("the prefill engine to go", lambda: not _members(g.url).get("prefill"))
        # the engines are not reachable from here, so health checks eject them; membership stays
        insts = httpx.get(f"{g.url}/instances", timeout=5).json()
        assert {i["role"] for i in insts} == {"decode"}
    finally:
        g.stop()


def _try(fn: Any) -> Any:
    try:
        return fn()
    except httpx.HTTPError:
        return None
