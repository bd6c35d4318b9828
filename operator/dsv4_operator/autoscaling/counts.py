"""What Kubernetes says about a role's instances, for the autoscaler (pure, from the watch cache).

An instance is one engine StatefulSet. It is ready when every pod is (``observe``'s rule), else
starting; a starting instance with a pod the scheduler has refused for longer than
``blocked_after_s`` is blocked (capacity that will not come).
Instances being drained are counted apart: they are neither capacity nor on their way. A
rollout's surge instances are not counted (they go when the rollout ends).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Any

from dsv4_operator.autoscaling.gateway_source import RoleCounts
from dsv4_operator.autoscaling.policy import ROLES, Role
from dsv4_operator.observe import workload_ready
from dsv4_operator.reconcile import names

BLOCKED_AFTER_S = 60.0


def unschedulable_since(pod: Mapping[str, Any]) -> float | None:
    """When the scheduler refused the pod (epoch seconds), or None while it is not refused."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            at = c.get("lastTransitionTime")
            return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp() if at else 0.0
    return None


def role_counts(
    workloads: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    draining: Mapping[Role, Collection[str]],
    now: float,
    blocked_after_s: float = BLOCKED_AFTER_S,
) -> dict[Role, RoleCounts]:
    """``workloads``: the deployment's StatefulSets; ``pods``: its pods; ``now``: epoch seconds."""
    refused: set[str] = set()
    for pod in pods:
        since = unschedulable_since(pod)
        if since is not None and now - since > blocked_after_s:
            labels = pod["metadata"].get("labels") or {}
            role, idx = labels.get(names.ROLE_LABEL), labels.get(names.INSTANCE_LABEL)
            if role in ROLES and idx is not None:
                refused.add(f"{pod['metadata'].get('namespace', '')}/{role}/{idx}")
    out: dict[Role, RoleCounts] = {}
    for role in ROLES:
        ready = starting = blocked = drained = 0
        for w in workloads:
            meta = w["metadata"]
            labels = meta.get("labels") or {}
            # a rollout's surge instance is there only until the rollout ends: not capacity
            if labels.get(names.ROLE_LABEL) != role or labels.get(names.SURGE_LABEL) == "true":
                continue
            if meta["name"] in draining.get(role, ()):
                drained += 1
            elif workload_ready(dict(w)):
                ready += 1
            else:
                starting += 1
                key = f"{meta.get('namespace', '')}/{role}/{labels.get(names.INSTANCE_LABEL)}"
                blocked += key in refused
        out[role] = RoleCounts(ready=ready, starting=starting, draining=drained, blocked=blocked)
    return out
