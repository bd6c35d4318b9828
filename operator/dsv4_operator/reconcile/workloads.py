"""Engine workloads: one StatefulSet per instance (stable pod identities, index = node rank), or
one LeaderWorkerSet per role (group = instance) when its CRD is installed and chosen."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import DeploymentSpec, RoleSpec
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.engine_pod import pod_template
from dsv4_operator.reconcile.identity import LeaderWorkerSetIdentity, StatefulSetIdentity

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def statefulset(spec: DeploymentSpec, role: RoleSpec, instance: int) -> dict[str, Any]:
    labels = names.instance_labels(spec, role.role, instance)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": names.metadata(spec, names.instance_name(spec, role.role, instance), labels),
        "spec": {
            "replicas": role.nodes_per_instance,
            "serviceName": names.role_service_name(spec, role.role),
            "selector": {"matchLabels": names.selector_for(labels)},
            # All nodes of an instance form one engine: start and replace them together.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "template": pod_template(spec, role, StatefulSetIdentity(instance)),
        },
    }


def leaderworkerset(spec: DeploymentSpec, role: RoleSpec) -> dict[str, Any]:
    labels = names.role_labels(spec, role.role)
    template = pod_template(spec, role, LeaderWorkerSetIdentity())
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": names.metadata(spec, names.leaderworkerset_name(spec, role.role), labels),
        "spec": {
            "replicas": role.instances,
            "leaderWorkerTemplate": {"size": role.nodes_per_instance, "workerTemplate": template},
            "startupPolicy": "LeaderCreated",
        },
    }


def engine_workloads(spec: DeploymentSpec, role: RoleSpec) -> list[dict[str, Any]]:
    if spec.scheduling.use_lws:
        return [leaderworkerset(spec, role)]
    return [statefulset(spec, role, i) for i in range(role.instances)]
