"""What the autoscaler asks of a sync (pure): per role the target count and the instances being
drained, plus the status it reports. The loop writes one per deployment; the sync reads it.

The target is persisted as ``status.<role>.desired`` and the drains as ``status.<role>.draining``,
so a restarted operator (or a sync before the loop's first tick) resumes from the status:
``from_status``. A draining instance is the highest index of its role and stays rendered (its
StatefulSet survives) until its drain ends, so a role renders ``max(target, drained index + 1)``
instances.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dsv4_operator.api import API_VERSION
from dsv4_operator.api.rolescale import ROLE_SCALE_KIND
from dsv4_operator.api.spec import ROLES, DeploymentSpec, Role
from dsv4_operator.autoscaling.report import disabled_conditions
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.identity import STS_POD_INDEX

ROUTING_KEY = "routing.json"
"""Key of the routing ConfigMap ``<name>-routing``: ``{"draining": [instance names],
"revision": newest, "revisions": {instance: revision}}``."""

ConditionTuple = tuple[str, str, str, str]


@dataclass(frozen=True)
class ScalePlan:
    targets: dict[Role, int]
    draining: dict[Role, tuple[str, ...]] = field(
        default_factory=lambda: {"prefill": (), "decode": ()}
    )
    autoscaling: dict[str, Any] | None = None
    """``status.autoscaling`` (None before the first tick)."""
    metrics: dict[str, str] = field(default_factory=dict)
    """``status.metrics``: ttft, tpot."""
    conditions: tuple[ConditionTuple, ...] = ()


def instance_index(spec: DeploymentSpec, role: Role, instance: str) -> int | None:
    prefix = f"{spec.name}-{role}-"
    tail = instance[len(prefix) :] if instance.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def rendered(spec: DeploymentSpec, plan: ScalePlan, role: Role) -> int:
    """Instances of ``role`` the sync renders: the target plus the ones still draining."""
    idx = [instance_index(spec, role, d) for d in plan.draining.get(role, ())]
    return max([plan.targets[role], *(i + 1 for i in idx if i is not None)])


def from_status(spec: DeploymentSpec, status: Mapping[str, Any] | None) -> ScalePlan:
    """The plan a restarted operator resumes from: the status's targets (clamped to the bounds;
    spec instances before any target was written) and drains."""
    status = status or {}
    targets: dict[Role, int] = {}
    draining: dict[Role, tuple[str, ...]] = {}
    for r in ROLES:
        role_status = status.get(r) or {}
        b = spec.autoscaling.bounds(r)
        desired = role_status.get("desired")
        base = int(desired) if isinstance(desired, int) else spec.role(r).instances
        targets[r] = max(b.min, min(b.max, base))
        draining[r] = tuple(
            d
            for d in role_status.get("draining") or []
            if isinstance(d, str) and instance_index(spec, r, d) is not None
        )
    return ScalePlan(
        targets,
        draining,
        autoscaling=status.get("autoscaling"),
        metrics=dict(status.get("metrics") or {}),
        conditions=tuple(
            (c["type"], c["status"], c.get("reason", ""), c.get("message", ""))
            for c in status.get("conditions") or []
            if c.get("type") in ("AutoscalingActive", "ScalingLimited")
        ),
    )


def effective_spec(spec: DeploymentSpec, plan: ScalePlan | None) -> DeploymentSpec:
    """The spec with the autoscaled instance counts (the spec itself when not autoscaled)."""
    if plan is None:
        return spec
    return replace(
        spec,
        prefill=replace(spec.prefill, instances=rendered(spec, plan, "prefill")),
        decode=replace(spec.decode, instances=rendered(spec, plan, "decode")),
    )


def routing_configmap(
    spec: DeploymentSpec,
    plan: ScalePlan | None,
    revision: str = "",
    revisions: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What every gateway replica reads to stop routing new requests to draining instances,
    and to pair prefill and decode of one revision only (``revision``: the newest, preferred;
    ``revisions``: each instance's)."""
    draining = sorted(d for r in ROLES for d in (plan.draining[r] if plan else ()))
    doc: dict[str, Any] = {"draining": draining}
    if revision:
        doc |= {"revision": revision, "revisions": dict(sorted((revisions or {}).items()))}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(
            spec, names.routing_name(spec), names.base_labels(spec, "routing")
        ),
        "data": {ROUTING_KEY: json.dumps(doc)},
    }


def status_conditions(plan: ScalePlan | None) -> list[ConditionTuple]:
    if plan is None:
        return disabled_conditions()
    return list(plan.conditions)


class PlanBook:
    """The newest plan per deployment: written by the loops (event loop), read by the syncs
    (threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[tuple[str, str], ScalePlan] = {}

    def put(self, namespace: str, name: str, plan: ScalePlan) -> None:
        with self._lock:
            self._plans[(namespace, name)] = plan

    def get(self, namespace: str, name: str) -> ScalePlan | None:
        with self._lock:
            return self._plans.get((namespace, name))

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._plans.pop((namespace, name), None)

    def plan_for(self, spec: DeploymentSpec, status: Mapping[str, Any] | None) -> ScalePlan | None:
        """What a sync renders: None when autoscaling is off; else the loop's plan, or the
        status's until the loop's first tick (a restarted operator)."""
        if not spec.autoscaling.enabled:
            return None
        return self.get(spec.namespace, spec.name) or from_status(spec, status)


def role_scales(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """``mode: External``: one ``DeepSeekV4RoleScale`` per role. ``spec.replicas`` is left out of
    what the operator applies, so the HPA's writes are never reverted by its forced apply."""
    return [
        {
            "apiVersion": API_VERSION,
            "kind": ROLE_SCALE_KIND,
            "metadata": names.metadata(spec, role_scale_name(spec, r), names.role_labels(spec, r)),
            "spec": {},
        }
        for r in ROLES
    ]


def role_scale_name(spec: DeploymentSpec, role: Role) -> str:
    return f"{spec.name}-{role}"


def rank0_selector(spec: DeploymentSpec, role: Role) -> str:
    """The role's rank-0 engine pods: one per instance (``status.selector`` of its scale)."""
    labels = {names.DEPLOYMENT_LABEL: spec.name, names.ROLE_LABEL: role, STS_POD_INDEX: "0"}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
