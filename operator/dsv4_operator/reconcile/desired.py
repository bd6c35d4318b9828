"""desired_children: the whole set of objects one DeepSeekV4Deployment should own."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from dsv4_operator.api.spec import ROLES, DeploymentSpec, Role, RoleSpec
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.budgets import disruption_budgets
from dsv4_operator.reconcile.engine_config import engine_configmap
from dsv4_operator.reconcile.errors import ReconcileError
from dsv4_operator.reconcile.gateway import gateway_objects
from dsv4_operator.reconcile.network import gateway_service, network_policies, role_service
from dsv4_operator.reconcile.ranktable import PodPlacement, rank_table
from dsv4_operator.reconcile.revision import revision
from dsv4_operator.reconcile.workloads import engine_workloads
from dsv4_operator.rollout.plan import RolePlan, Slot, new_revision_serves, plan_role

__all__ = [
    "Facts",
    "ReconcileError",
    "desired_children",
    "instance_revisions",
    "kept_children",
    "rollout_plans",
]


@dataclass(frozen=True)
class Facts:
    """What ``observe`` read from the cluster; everything else is derived from the spec."""

    kv_token: str
    """The KV sidecars' shared secret: the existing Secret's, or a fresh one on first reconcile."""
    placements: dict[tuple[Role, int], list[PodPlacement]] = field(default_factory=dict)
    """Engine pods per (role, instance), for the HCCL rank tables."""
    lws_available: bool = False
    """Whether the LeaderWorkerSet CRD is installed."""
    slots: dict[Role, tuple[Slot, ...]] = field(default_factory=dict)
    """The live instances (StatefulSets) per role: index, revision label, readiness."""
    pinned: dict[Role, frozenset[int]] = field(default_factory=dict)
    """Instances the autoscaler is draining: left as they are until it deletes them."""


def _holds(spec: DeploymentSpec, facts: Facts, rev: str) -> dict[Role, bool]:
    """Per role, whether its ready old instances must stay this sync (rollout/plan.py)."""
    # until the new revision has a ready instance of every role it cannot serve a request, so
    # the old one keeps all its ready instances
    complete = all(
        new_revision_serves(facts.slots.get(r, ()), rev) for r in ROLES if spec.role(r).instances
    )
    # prefill first: a request prefilled on an old instance is decoded on an old one, so old
    # decodes stay until every prefill instance is a ready one of the new revision (the old
    # pods are gone then: a StatefulSet starts a pod's successor after it ended)
    prefill_done = all(s.revision == rev and s.ready for s in facts.slots.get("prefill", ()))
    # with no surge a role's new instances come only from replacing old ones: never held
    return {
        "prefill": not complete and spec.prefill.rollout.max_surge > 0,
        "decode": (not complete or not prefill_done) and spec.decode.rollout.max_surge > 0,
    }


def rollout_plans(spec: DeploymentSpec, facts: Facts) -> dict[Role, RolePlan]:
    """Per role, the instances rendered at the spec's revision and those kept as they are."""
    rev = revision(spec)
    holds = _holds(spec, facts, rev)
    plans: dict[Role, RolePlan] = {}
    for r in ROLES:
        role = spec.role(r)
        plans[r] = plan_role(
            facts.slots.get(r, ()),
            role.instances,
            rev,
            role.rollout.max_surge,
            role.rollout.max_unavailable,
            hold_old=holds[r],
            pinned=facts.pinned.get(r, frozenset()),
        )
    return plans


def instance_revisions(spec: DeploymentSpec, facts: Facts) -> dict[str, str]:
    """Each instance this sync leaves on the cluster and the revision it runs (the gateway
    pairs prefill and decode of one revision only)."""
    if spec.scheduling.use_lws:
        return {}
    rev = revision(spec)
    out: dict[str, str] = {}
    for r, plan in rollout_plans(spec, facts).items():
        live = {s.index: s.revision for s in facts.slots.get(r, ())}
        out |= {names.instance_name(spec, r, i): rev for i in plan.update}
        out |= {names.instance_name(spec, r, i): live[i] for i in plan.keep if i in live}
    return out


def kept_children(spec: DeploymentSpec, facts: Facts) -> frozenset[tuple[str, str]]:
    """The StatefulSets a sync must neither apply nor delete (old revision, not replaced yet)."""
    if spec.scheduling.use_lws:
        return frozenset()
    return frozenset(
        ("StatefulSet", names.instance_name(spec, r, i))
        for r, plan in rollout_plans(spec, facts).items()
        for i in plan.keep
    )


def _configmap(
    spec: DeploymentSpec, name: str, labels: dict[str, str], data: dict[str, str]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(spec, name, labels),
        "data": data,
    }


def _ranktables(
    spec: DeploymentSpec, role: RoleSpec, facts: Facts, instances: tuple[int, ...]
) -> list[dict[str, Any]]:
    if not role.on_npu:
        return []
    tables = {
        i: rank_table(
            facts.placements.get((role.role, i), []), role.nodes_per_instance, role.npus_per_node
        )
        for i in instances
    }
    if spec.scheduling.use_lws:
        data = {f"hccl-{i}.json": json.dumps(t, indent=2) for i, t in tables.items()}
        return [
            _configmap(
                spec,
                names.ranktables_name(spec, role.role),
                names.role_labels(spec, role.role),
                data,
            )
        ]
    return [
        _configmap(
            spec,
            names.ranktable_name(spec, role.role, i),
            names.instance_labels(spec, role.role, i),
            {"hccl.json": json.dumps(t, indent=2)},
        )
        for i, t in tables.items()
    ]


def desired_children(spec: DeploymentSpec, facts: Facts) -> list[dict[str, Any]]:
    """Every child object, fully specified, in an order that is safe to apply front to back."""
    if spec.scheduling.use_lws and not facts.lws_available:
        raise ReconcileError(
            "scheduling.workload is LeaderWorkerSet but the LeaderWorkerSet CRD "
            "(leaderworkersets.leaderworkerset.x-k8s.io) is not installed; install LWS or use StatefulSet"
        )
    objs: list[dict[str, Any]] = [
        engine_configmap(spec),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": names.metadata(
                spec, names.kv_secret_name(spec), names.base_labels(spec, "kv-transfer")
            ),
            "type": "Opaque",
            "data": {"token": base64.b64encode(facts.kv_token.encode()).decode()},
        },
    ]
    plans = rollout_plans(spec, facts)
    rev = revision(spec)
    for r in ROLES:
        role = spec.role(r)
        objs.append(role_service(spec, r))
        rendered = tuple(range(role.instances)) if spec.scheduling.use_lws else plans[r].rendered
        objs += _ranktables(spec, role, facts, rendered)
        objs += engine_workloads(spec, role, plans[r].update, rev, plans[r].surge)
    objs += gateway_objects(spec)
    objs.append(gateway_service(spec))
    objs += disruption_budgets(spec)
    objs += network_policies(spec)
    return objs
