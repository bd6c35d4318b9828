"""What of the node a deployment may reach: opt-in per operator installation, never per CR.

Anyone allowed to create a DeepSeekV4Deployment in a watched namespace would otherwise mount any
node directory (``model.path``, a hostPath volume) or run privileged containers
(``features.privileged``): the operator renders them only when whoever installed it said so
(chart values ``hostAccess.*``, which set the flags below).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.reconcile.errors import ReconcileError


@dataclass(frozen=True)
class HostAccess:
    model_path: bool = False
    """``dsv4 operator --allow-host-path-models`` (chart: ``hostAccess.modelPath``)."""
    privileged: bool = False
    """``dsv4 operator --allow-privileged`` (chart: ``hostAccess.privileged``)."""


def check_host_access(spec: DeploymentSpec, allowed: HostAccess) -> None:
    """Raise InvalidSpec naming the chart value that allows what ``spec`` asks for."""
    if spec.model.path and not allowed.model_path:
        raise ReconcileError(
            f"model.path {spec.model.path} would mount a directory of the node (hostPath), which "
            "this operator does not allow: use model.pvc, or install the dsv4 chart with "
            "--set hostAccess.modelPath=true (dsv4 operator --allow-host-path-models)"
        )
    if spec.features.privileged and not allowed.privileged:
        raise ReconcileError(
            "features.privileged would run the engine containers privileged, which this "
            "operator does not allow: install the dsv4 chart with --set "
            "hostAccess.privileged=true (dsv4 operator --allow-privileged)"
        )
