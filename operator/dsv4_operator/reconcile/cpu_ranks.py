"""Torch threads of each rank process of a CPU engine pod.

A CPU pod (``npusPerNode: 0``) runs ``tp * cp * dp / nodesPerInstance`` rank processes on the CPUs
Kubernetes gives its engine container. Left to itself each rank would start as many threads as
the host has cores (a container sees them all), so the ranks of one pod would oversubscribe its
share many times over. The operator therefore renders ``--threads-per-rank``: the container's
CPUs, its limit (the hard cap) else its request, split evenly over the pod's ranks, at least 1.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from dsv4_operator.api.spec import RoleSpec
from dsv4_operator.reconcile.shm import quantity


def container_cpus(resources: dict[str, Any]) -> Decimal | None:
    """The engine container's CPUs: its limit, else its request; None when neither is set."""
    for kind in ("limits", "requests"):
        cpu = (resources.get(kind) or {}).get("cpu")
        if cpu is not None:
            return quantity(str(cpu))
    return None


def rank_threads(role: RoleSpec) -> int:
    """``--threads-per-rank`` of a CPU pod's ranks; 0 (the engine's default: the CPUs it sees
    split over its ranks) when the role's resources name no CPU."""
    cpus = container_cpus(role.resources)
    if cpus is None:
        return 0
    return max(1, int(cpus // role.ranks_per_node))
