"""PodDisruptionBudgets: voluntary evictions (node drains) take one engine pod, so one instance,
per role at a time, and one gateway replica when there is more than one."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import ROLES, DeploymentSpec
from dsv4_operator.reconcile import names


def _budget(spec: DeploymentSpec, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": names.metadata(spec, name, labels),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_for(labels)}},
    }


def disruption_budgets(spec: DeploymentSpec) -> list[dict[str, Any]]:
    out = [
        _budget(spec, names.role_budget_name(spec, role), names.role_labels(spec, role))
        for role in ROLES
    ]
    if spec.gateway.replicas > 1:
        out.append(_budget(spec, names.gateway_name(spec), names.gateway_labels(spec)))
    return out
