"""Small helpers for the operator's k8s tests (the process itself: ``OperatorService``)."""

from __future__ import annotations

import json
from typing import Any

from dsv4_devcluster.operator_process import OperatorService

__all__ = ["OperatorService", "apply_yaml", "kubectl_json", "warning_events"]


def kubectl_json(cluster: Any, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.kubectl(*args, "-o", "json"))
    return out


def apply_yaml(cluster: Any, text: str, namespace: str) -> str:
    return str(cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text))


def warning_events(cluster: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    """The Warning events about the object ``name`` (a DeepSeekV4Deployment)."""
    items: list[dict[str, Any]] = kubectl_json(
        cluster,
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={name},type=Warning",
    )["items"]
    return items
