"""Engine workloads: one StatefulSet per instance (stable pod identities, index = node rank), or
one LeaderWorkerSet per role (group = instance) when its CRD is installed and chosen."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import DeploymentSpec, RoleSpec
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.engine_pod import pod_template

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def statefulset(spec: DeploymentSpec, role: RoleSpec, instance: int) -> dict[str, Any]:
    labels = names.instance_labels(spec, role.role, instance)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": names.metadata(spec, names.instance_name(spec, role.role, instance), labels),
        "spec": {
            "replicas": role.nodes_per_instance,
            "serviceName": names.role_service(spec, role.role),
            "selector": {"matchLabels": names.selector_for(labels)},
            # All nodes of an instance form one engine: start and replace them together.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "template": pod_template(spec, role, instance),
        },
    }


def leaderworkerset(spec: DeploymentSpec, role: RoleSpec) -> dict[str, Any]:
    labels = names.role_labels(spec, role.role)
    template = pod_template(spec, role, 0, lws=True)
    # In a LeaderWorkerSet the group index is the instance; the worker index is the node rank.
    for c in template["spec"]["containers"]:
        for e in c.get("env", []):
            if e["name"] == "DSV4_INSTANCE":
                e.pop("value")
                e["valueFrom"] = {
                    "fieldRef": {
                        "fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"
                    }
                }
            elif e["name"] == "DSV4_NODE_RANK":
                e["valueFrom"] = {
                    "fieldRef": {
                        "fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
                    }
                }
            elif e["name"] == "DSV4_MASTER_ADDR":
                e.pop("value")
                e["valueFrom"] = {
                    "fieldRef": {
                        "fieldPath": "metadata.annotations['leaderworkerset.sigs.k8s.io/leader-name']"
                    }
                }
    template["metadata"]["labels"] = labels
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": names.metadata(spec, f"{spec.name}-{role.role}", labels),
        "spec": {
            "replicas": role.instances,
            "leaderWorkerTemplate": {"size": role.nodes_per_instance, "workerTemplate": template},
            "startupPolicy": "LeaderCreated",
        },
    }


def engine_workloads(spec: DeploymentSpec, role: RoleSpec, use_lws: bool) -> list[dict[str, Any]]:
    if use_lws:
        return [leaderworkerset(spec, role)]
    return [statefulset(spec, role, i) for i in range(role.instances)]
