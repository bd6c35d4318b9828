"""A replica that starts after another was killed does not pause for the dead one's peering
entry (``dsv4_operator/peers.py``): on the real control plane, an operator process with the
chart's identity (``POD_ID``, ``POD_NAMESPACE``) and a peering object holding a fresh entry of
a pod that is gone (kopf's 60 s lifetime: without the clean-up it pauses that long)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from tests.helpers import wait_for
from tests.k8s.operator_fixtures import OperatorService, kubectl_json

PEERING = "peers-test"
DEAD, LIVE, DEV = "dsv4-operator-6d9f-x1", "dsv4-operator-6d9f-x2", "root@devbox/20261205"
OWN = "dsv4-operator-6d9f-x3"


def _entry(priority: int) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")
    return {"priority": priority, "lifetime": 60, "lastseen": now}


def _pod(name: str, ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"containers": [{"name": "c", "image": "x"}], "nodeName": "nowhere"},
    }


def _peers(cluster: Any) -> dict[str, Any]:
    return kubectl_json(cluster, "get", "clusterkopfpeering", PEERING).get("status") or {}


def test_a_dead_pods_entry_is_dropped_and_the_new_replica_runs_at_once(
    k8s_cluster: Any, operator_kubeconfig: Any, namespace: str
) -> None:
    cluster, ns = k8s_cluster, namespace
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_pod(LIVE, ns)))
    peering = {
        "apiVersion": "kopf.dev/v1",
        "kind": "ClusterKopfPeering",
        "metadata": {"name": PEERING},
        # the dead pod had this replica's priority; the live pod and the dev id are lower
        "status": {DEAD: _entry(0), LIVE: _entry(-5), DEV: _entry(-5)},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(peering))
    extra = ("--peering", PEERING, "--priority", "0")  # the dead pod's: it would pause us
    op = OperatorService(operator_kubeconfig, cluster.log_dir, extra=extra)
    op.start(env={"PYTHONUNBUFFERED": "1", "POD_ID": OWN, "POD_NAMESPACE": ns})
    try:
        op.wait_ready(60)
        wait_for("its own entry", lambda: OWN in _peers(cluster), timeout_s=30)
        peers = _peers(cluster)
        assert DEAD not in peers
        assert LIVE in peers and DEV in peers  # a live pod's, and an id that is no pod name
        assert "dropped the peering entries of pods that are gone: " + DEAD in op.tail(400)
        assert "Pausing operations" not in op.tail(400)
    finally:
        op.stop()
        cluster.kubectl("delete", "clusterkopfpeering", PEERING, check=False)


def test_two_replicas_of_the_chart_elect_one_without_a_priority_each(
    k8s_cluster: Any, operator_kubeconfig: Any, namespace: str
) -> None:
    """No ``--priority`` (the chart's command): each pod's priority comes from its name, so
    one replica runs and the other stands by; with one shared priority kopf pauses both."""
    cluster = k8s_cluster
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering"}
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({**peering, "metadata": {"name": PEERING}})
    )
    pods = [f"dsv4-operator-7d9c-{s}" for s in ("abcde", "fghij")]
    for pod in pods:  # the replicas' pods exist: neither drops the other's entry
        cluster.kubectl("apply", "-f", "-", input=json.dumps(_pod(pod, namespace)))
    ops = [
        OperatorService(operator_kubeconfig, cluster.log_dir, extra=("--peering", PEERING))
        for _ in pods
    ]
    try:
        for op, pod in zip(ops, pods, strict=True):
            op.start(env={"PYTHONUNBUFFERED": "1", "POD_ID": pod, "POD_NAMESPACE": namespace})
            op.wait_ready(60)
        wait_for("both entries", lambda: set(pods) <= set(_peers(cluster)), timeout_s=30)
        prio = {p: e["priority"] for p, e in _peers(cluster).items()}
        low = min(pods, key=lambda p: prio[p])
        standby = ops[pods.index(low)]
        wait_for(
            "the lower one to stand by",
            lambda: "Pausing operations in favour of" in standby.tail(400),
            timeout_s=60,
        )
        for op in ops:
            assert "Possibly conflicting operators" not in op.tail(400)
        assert "Pausing operations" not in ops[1 - pods.index(low)].tail(400)
    finally:
        for op in ops:
            op.stop()
        cluster.kubectl("delete", "clusterkopfpeering", PEERING, check=False)
