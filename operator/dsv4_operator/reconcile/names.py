"""Names, labels and owner references shared by every child object: every child's name is built
here and nowhere else."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api import API_VERSION, KIND
from dsv4_operator.api.spec import DeploymentSpec, Role

MANAGER = "dsv4-operator"
ROLE_LABEL = "serving.dsv4.io/role"
INSTANCE_LABEL = "serving.dsv4.io/instance"
# What an engine instance runs (reconcile/revision.py): on its StatefulSet and its pods; never in
# a selector (a selector is immutable, the revision changes)
REVISION_LABEL = "serving.dsv4.io/revision"
# On a StatefulSet a rollout started above the instance count (deleted when the rollout ends);
# not on its pods, so the mark comes and goes without a restart
SURGE_LABEL = "serving.dsv4.io/surge"
DEPLOYMENT_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# Set by the Ascend device plugin on each pod: the NPUs it got and their RoCE IPs.
ASCEND_DEVICE_ANNOTATION = "ascend.kubectl.kubernetes.io/ascend-910-configuration"

# The hash of what the operator last applied to a child; a child whose hash matches and whose
# live fields still hold what was applied is left alone (no write).
DESIRED_HASH_ANNOTATION = "serving.dsv4.io/desired-hash"

GATEWAY_PORT = 8000
METRICS_PORT_NAME = "http"


def base_labels(spec: DeploymentSpec, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dsv4",
        DEPLOYMENT_LABEL: spec.name,
        "app.kubernetes.io/component": component,
        MANAGED_BY_LABEL: MANAGER,
    }


def role_labels(spec: DeploymentSpec, role: Role) -> dict[str, str]:
    return {**base_labels(spec, role), ROLE_LABEL: role}


def instance_labels(spec: DeploymentSpec, role: Role, index: int) -> dict[str, str]:
    return {**role_labels(spec, role), INSTANCE_LABEL: str(index)}


def gateway_labels(spec: DeploymentSpec) -> dict[str, str]:
    return {**base_labels(spec, "gateway"), ROLE_LABEL: "gateway"}


def selector_for(labels: dict[str, str]) -> dict[str, str]:
    """The immutable subset used in selectors (no component/managed-by churn)."""
    keys = (DEPLOYMENT_LABEL, ROLE_LABEL, INSTANCE_LABEL)
    return {k: v for k, v in labels.items() if k in keys}


def role_service_name(spec: DeploymentSpec, role: Role) -> str:
    """The headless Service of a role (engine pods' DNS, the gateway's EndpointSlices)."""
    return f"{spec.name}-{role}"


def leaderworkerset_name(spec: DeploymentSpec, role: Role) -> str:
    return f"{spec.name}-{role}"


def role_budget_name(spec: DeploymentSpec, role: Role) -> str:
    return f"{spec.name}-{role}"


def gateway_policy_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-gateway"


def engines_policy_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-engines"


def instance_name(spec: DeploymentSpec, role: Role, index: int) -> str:
    """The StatefulSet of one instance; its pods are ``{instance_name}-{node rank}``."""
    return f"{spec.name}-{role}-{index}"


def leader_address(spec: DeploymentSpec, role: Role, index: int) -> str:
    """DNS name of an instance's node-rank-0 pod (StatefulSet mode), through the role Service."""
    return f"{instance_name(spec, role, index)}-0.{role_service_name(spec, role)}"


def ranktable_name(spec: DeploymentSpec, role: Role, index: int) -> str:
    return f"{instance_name(spec, role, index)}-ranktable"


def ranktables_name(spec: DeploymentSpec, role: Role) -> str:
    return f"{spec.name}-{role}-ranktables"


def engine_config_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-engine"


def kv_secret_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-kv-auth"


def routing_name(spec: DeploymentSpec) -> str:
    """The ConfigMap listing the instances being drained (every gateway replica reads it)."""
    return f"{spec.name}-routing"


def gateway_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-gateway"


def owner_reference(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(
    spec: DeploymentSpec,
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": spec.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(spec)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta
