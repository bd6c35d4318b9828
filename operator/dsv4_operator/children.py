"""The children of one deployment on the cluster: read them (from the watch cache, or one LIST per
kind), bring them to the desired set (apply what differs, create what is missing, delete what is
no longer wanted).

Only objects whose owner reference carries this deployment's uid count as its children, so a
same-named successor never inherits (or prunes) its predecessor's objects, and an object someone
else made under one of our names is reported instead of adopted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import Counter

from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.drift import stamp, up_to_date
from dsv4_operator.kube import KubeApi, KubeError
from dsv4_operator.reconcile import names, origin

CREATED = Counter("dsv4_operator_children_created", "Child objects created", ["kind"])
UPDATED = Counter("dsv4_operator_children_updated", "Child objects changed", ["kind"])
DELETED = Counter("dsv4_operator_children_deleted", "Child objects deleted", ["kind"])

# Kinds the operator owns and prunes (LeaderWorkerSet only when its CRD exists).
OWNED_KINDS = (
    "DeepSeekV4RoleScale",
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
    return {names.DEPLOYMENT_LABEL: spec.name, names.MANAGED_BY_LABEL: names.MANAGER}


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


@dataclass
class ApplyResult:
    created: list[Key] = field(default_factory=list)
    updated: list[Key] = field(default_factory=list)
    deleted: list[Key] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    """Desired children whose name an object someone else made holds, one line each."""
    refused: list[str] = field(default_factory=list)
    """Why the API server refused the desired set, one line per cause, each naming the field
    of the deployment it came from; when not empty, nothing was written."""
    seen: Live = field(default_factory=dict)
    """The newest copy of each child this sync read (a GET) or wrote (the API server's answer)."""
    deleted_objects: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class ChildView(Protocol):
    """Where a sync reads a deployment's children and engine pods from."""

    def children(self, spec: DeploymentSpec, lws_available: bool) -> Live: ...

    def pods(self, spec: DeploymentSpec) -> list[dict[str, Any]]: ...

    def remember(self, result: ApplyResult) -> None: ...

    def may_exist(self, kind: str, namespace: str, name: str) -> bool:
        """False only when an object of that name certainly does not exist (no GET needed)."""
        ...

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The deployment as last reported, or None when not known here (GET it)."""
        ...

    def record_deployment(self, body: dict[str, Any]) -> bool: ...


class ListedChildren:
    """Read through the API: one LIST per owned kind, one of the pods, a GET of the deployment
    and of each missing child (no cache to keep)."""

    def __init__(self, kube: KubeApi) -> None:
        self.kube = kube

    def children(self, spec: DeploymentSpec, lws_available: bool) -> Live:
        kinds = (*OWNED_KINDS, *(("LeaderWorkerSet",) if lws_available else ()))
        out: Live = {}
        for kind in kinds:
            for obj in self.kube.list(kind, spec.namespace, managed_selector(spec)):
                if owned_by(obj, spec.uid):
                    out[(kind, obj["metadata"]["name"])] = obj
        return out

    def pods(self, spec: DeploymentSpec) -> list[dict[str, Any]]:
        return self.kube.list("Pod", spec.namespace, {names.DEPLOYMENT_LABEL: spec.name})

    def remember(self, result: ApplyResult) -> None:
        pass

    def may_exist(self, kind: str, namespace: str, name: str) -> bool:
        return True

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None

    def record_deployment(self, body: dict[str, Any]) -> bool:
        return True


def _refusal(kube: KubeApi, obj: dict[str, Any], dry_run: bool) -> list[str] | dict[str, Any]:
    """The API server's answer to applying ``obj``, or why it refused it."""
    try:
        return kube.apply(obj, dry_run=dry_run)
    except KubeError as e:
        if dry_run and e.status == 404:
            # it names an object this same set creates first (a RoleBinding's Role), which a dry
            # run cannot see; the real apply, in order, judges it
            return obj
        if e.status not in _REJECTED:
            raise
        return origin.refusal(obj, e.causes, e.message)


def apply_children(
    kube: KubeApi,
    desired: list[dict[str, Any]],
    live: Live,
    uid: str,
    may_exist: Callable[[str, str, str], bool] = lambda kind, namespace, name: True,
    keep: frozenset[Key] = frozenset(),
) -> ApplyResult:
    """Apply (server-side, forced) each desired child that differs from its live copy, then
    delete live children that are not desired. An unchanged child costs no request; one missing
    from ``live`` is read first (it may be someone else's, or ``live`` may lag) unless
    ``may_exist`` says its name is free. A child in ``keep`` is neither applied nor deleted
    (an instance a rollout has not replaced yet).

    The changed children are first applied as a dry run, all of them: one the API server refuses
    leaves every child as it was (no half-built deployment, nothing pruned). A single change is
    its own dry run."""
    result = ApplyResult()
    changed: list[tuple[Key, dict[str, Any], dict[str, Any] | None]] = []
    for obj in desired:
        key: Key = (obj["kind"], obj["metadata"]["name"])
        stamped = stamp(obj)
        current = live.get(key)
        namespace = obj["metadata"]["namespace"]
        if current is None and may_exist(key[0], namespace, key[1]):
            current = kube.get(key[0], namespace, key[1])
            if current is not None and not owned_by(current, uid):
                # never adopt (and later prune) an object someone else made under our name
                result.foreign.append(
                    f"{key[0]} {key[1]} already exists and is not owned by this "
                    "DeepSeekV4Deployment"
                )
                continue
            if current is not None:
                result.seen[key] = current
        if current is None or not up_to_date(stamped, current):
            changed.append((key, stamped, current))
    if len(changed) > 1:
        for _, stamped, _ in changed:
            answer = _refusal(kube, stamped, dry_run=True)
            if isinstance(answer, list):
                result.refused += [line for line in answer if line not in result.refused]
        if result.refused:
            return result
    for key, stamped, current in changed:
        answer = _refusal(kube, stamped, dry_run=False)
        if isinstance(answer, list):
            # refused now but not in the dry run (an admission that changed in between)
            result.refused += answer
            continue
        result.seen[key] = answer
        if current is None:
            result.created.append(key)
            CREATED.labels(key[0]).inc()
        else:
            result.updated.append(key)
            UPDATED.labels(key[0]).inc()
    if result.refused:
        return result  # pruning waits for a desired set that applies whole
    wanted = {(o["kind"], o["metadata"]["name"]) for o in desired} | keep
    for kind, name in sorted(set(live) - wanted):
        obj = live[(kind, name)]
        kube.delete(kind, obj["metadata"]["namespace"], name)
        result.deleted.append((kind, name))
        result.deleted_objects.append((kind, obj))
        DELETED.labels(kind).inc()
    return result
