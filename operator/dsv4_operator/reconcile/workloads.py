"""Engine workloads: one StatefulSet per instance (stable pod identities, index = node rank), or
one LeaderWorkerSet per role (group = instance) when its CRD is installed and chosen.

StatefulSets are labelled with the revision they run and rendered only for the instances the
rollout plan updates (``rollout/plan.py``): an instance it keeps is left as it is, so a spec
change never restarts every instance of a role at once. A LeaderWorkerSet rolls its groups
itself (its own rolling update, one group at a time)."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import DeploymentSpec, RoleSpec
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.engine_pod import pod_template
from dsv4_operator.reconcile.identity import LeaderWorkerSetIdentity, StatefulSetIdentity

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def statefulset(
    spec: DeploymentSpec, role: RoleSpec, instance: int, revision: str = "", surge: bool = False
) -> dict[str, Any]:
    labels = names.instance_labels(spec, role.role, instance)
    if revision:
        labels = {**labels, names.REVISION_LABEL: revision}
    meta_labels = {**labels, names.SURGE_LABEL: "true"} if surge else labels
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": names.metadata(
            spec, names.instance_name(spec, role.role, instance), meta_labels
        ),
        "spec": {
            "replicas": role.nodes_per_instance,
            "serviceName": names.role_service_name(spec, role.role),
            "selector": {"matchLabels": names.selector_for(labels)},
            # All nodes of an instance form one engine: start and replace them together.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "template": pod_template(spec, role, StatefulSetIdentity(instance), revision),
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


def engine_workloads(
    spec: DeploymentSpec,
    role: RoleSpec,
    update: tuple[int, ...],
    revision: str,
    surge: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """``update``: the instances rendered at ``revision`` (StatefulSet mode), ``surge`` of
    them marked as a rollout's surge."""
    if spec.scheduling.use_lws:
        return [leaderworkerset(spec, role)]
    return [statefulset(spec, role, i, revision, i in surge) for i in update]
