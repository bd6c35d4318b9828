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


def _peers(cluster: Any) -> dict[str, Any]:
    return kubectl_json(cluster, "get", "clusterkopfpeering", PEERING).get("status") or {}


def test_a_dead_pods_entry_is_dropped_and_the_new_replica_runs_at_once(
    k8s_cluster: Any, operator_kubeconfig: Any, namespace: str
) -> None:
    cluster, ns = k8s_cluster, namespace
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": LIVE, "namespace": ns},
        "spec": {"containers": [{"name": "c", "image": "x"}], "nodeName": "nowhere"},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    peering = {
        "apiVersion": "kopf.dev/v1",
        "kind": "ClusterKopfPeering",
        "metadata": {"name": PEERING},
        # the dead pod had this replica's priority; the live pod and the dev id are lower
        "status": {DEAD: _entry(0), LIVE: _entry(-5), DEV: _entry(-5)},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(peering))
    op = OperatorService(operator_kubeconfig, cluster.log_dir, extra=("--peering", PEERING))
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
