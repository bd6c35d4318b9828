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
from dsv4_operator.reconcile.workloads import engine_workloads

__all__ = ["Facts", "ReconcileError", "desired_children"]


@dataclass(frozen=True)
class Facts:
    """What ``observe`` read from the cluster; everything else is derived from the spec."""

    kv_token: str
    """The KV sidecars' shared secret: the existing Secret's, or a fresh one on first reconcile."""
    placements: dict[tuple[Role, int], list[PodPlacement]] = field(default_factory=dict)
    """Engine pods per (role, instance), for the HCCL rank tables."""
    lws_available: bool = False
    """Whether the LeaderWorkerSet CRD is installed."""


def _configmap(
    spec: DeploymentSpec, name: str, labels: dict[str, str], data: dict[str, str]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(spec, name, labels),
        "data": data,
    }


def _ranktables(spec: DeploymentSpec, role: RoleSpec, facts: Facts) -> list[dict[str, Any]]:
    if not role.on_npu:
        return []
    tables = {
        i: rank_table(
            facts.placements.get((role.role, i), []), role.nodes_per_instance, role.npus_per_node
        )
        for i in range(role.instances)
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
    for r in ROLES:
        role = spec.role(r)
        objs.append(role_service(spec, r))
        objs += _ranktables(spec, role, facts)
        objs += engine_workloads(spec, role)
    objs += gateway_objects(spec)
    objs.append(gateway_service(spec))
    objs += disruption_budgets(spec)
    objs += network_policies(spec)
    return objs
