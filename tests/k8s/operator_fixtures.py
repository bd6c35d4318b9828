"""Small helpers for the operator's k8s tests (the process itself: ``OperatorService``)."""

from __future__ import annotations

import json
from typing import Any

from dsv4_operator.devcluster.operator_process import OperatorService

__all__ = ["OperatorService", "apply_yaml", "kubectl_json"]


def kubectl_json(cluster: Any, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.kubectl(*args, "-o", "json"))
    return out


def apply_yaml(cluster: Any, text: str, namespace: str) -> str:
    return str(cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text))
