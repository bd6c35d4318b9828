"""The children of one deployment on the cluster: read them (one LIST per kind), bring them to
the desired set (apply what differs, create what is missing, delete what is no longer wanted).

Only objects whose owner reference carries this deployment's uid count as its children, so a
same-named successor never inherits (or prunes) its predecessor's objects, and an object someone
else made under one of our names is reported instead of adopted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.drift import stamp, up_to_date
from dsv4_operator.kube import KubeApi, KubeError
from dsv4_operator.reconcile import names

CREATED = Counter("dsv4_operator_children_created", "Child objects created", ["kind"])
UPDATED = Counter("dsv4_operator_children_updated", "Child objects changed", ["kind"])
DELETED = Counter("dsv4_operator_children_deleted", "Child objects deleted", ["kind"])

# Kinds the operator owns and prunes (LeaderWorkerSet only when its CRD exists).
OWNED_KINDS = (
    "ConfigMap",
    "Secret",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "StatefulSet",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
)
# The API server refused the object itself (invalid, forbidden, conflicting): a problem to show
# on the deployment, not a failure of the sync.
_REJECTED = (400, 403, 409, 422)

Key = tuple[str, str]  # (kind, name)
Live = dict[Key, dict[str, Any]]


def managed_selector(spec: DeploymentSpec) -> dict[str, str]:
    return {names.DEPLOYMENT_LABEL: spec.name, "app.kubernetes.io/managed-by": names.MANAGER}


def list_children(kube: KubeApi, spec: DeploymentSpec, lws_available: bool) -> Live:
    """Every child of this deployment that exists now, by (kind, name)."""
    kinds = (*OWNED_KINDS, *(("LeaderWorkerSet",) if lws_available else ()))
    out: Live = {}
    for kind in kinds:
        for obj in kube.list(kind, spec.namespace, managed_selector(spec)):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == spec.uid for r in refs):
                out[(kind, obj["metadata"]["name"])] = obj
    return out


@dataclass
class ApplyResult:
    created: list[Key] = field(default_factory=list)
    updated: list[Key] = field(default_factory=list)
    deleted: list[Key] = field(default_factory=list)
    unchanged: list[Key] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    """Why a desired child could not be applied, one line each."""


def _foreign(kube: KubeApi, obj: dict[str, Any]) -> bool:
    """Whether an object of that kind and name exists without our owner reference."""
    meta = obj["metadata"]
    current = kube.get(obj["kind"], meta["namespace"], meta["name"])
    if current is None:
        return False
    ours = meta["ownerReferences"][0]["uid"]
    refs = current["metadata"].get("ownerReferences") or []
    return not any(r.get("uid") == ours for r in refs)


def apply_children(kube: KubeApi, desired: list[dict[str, Any]], live: Live) -> ApplyResult:
    """Apply (server-side, forced) each desired child that differs from its live copy, then
    delete live children that are not desired. Unchanged children cost no request."""
    result = ApplyResult()
    for obj in desired:
        key: Key = (obj["kind"], obj["metadata"]["name"])
        stamped = stamp(obj)
        current = live.get(key)
        if current is not None and up_to_date(stamped, current):
            result.unchanged.append(key)
            continue
        if current is None and _foreign(kube, obj):
            result.rejected.append(
                f"{key[0]} {key[1]} already exists and is not owned by this DeepSeekV4Deployment"
            )
            continue
        try:
            kube.apply(stamped)
        except KubeError as e:
            if e.status not in _REJECTED:
                raise
            result.rejected.append(f"{key[0]} {key[1]} rejected: {e.message}")
            continue
        if current is None:
            result.created.append(key)
            CREATED.labels(key[0]).inc()
        else:
            result.updated.append(key)
            UPDATED.labels(key[0]).inc()
    wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
    for kind, name in sorted(set(live) - wanted):
        kube.delete(kind, live[(kind, name)]["metadata"]["namespace"], name)
        result.deleted.append((kind, name))
        DELETED.labels(kind).inc()
    return result
