"""Which field of the DeepSeekV4Deployment a child's field was rendered from, so that when the API
server refuses a child the user reads the field they wrote, not one of an object they never saw.

Pure: a child (its kind and labels say which role or component it belongs to) and the field path
the API server named in its refusal (``details.causes[].field``).
"""

from __future__ import annotations

import re
from typing import Any

from dsv4_operator.reconcile import names

# Where a pod spec sits in the workloads the operator renders.
_POD_SPEC = re.compile(r"^spec\.(?:template|leaderWorkerTemplate\.workerTemplate)\.spec\.")

# (pattern on the path inside the pod spec, CR field, whether the rest of the path carries over:
# it does where the child's list or map is the user's own, not where the operator adds entries).
_Rule = tuple[str, str, bool]
_SCHEDULING: list[_Rule] = [
    (r"tolerations", "spec.scheduling.tolerations", True),
    (r"affinity", "spec.scheduling.affinity", True),
    (r"nodeSelector", "spec.scheduling.nodeSelector", True),
    (r"topologySpreadConstraints", "spec.scheduling.topologySpreadConstraints", True),
    (r"priorityClassName", "spec.scheduling.priorityClassName", True),
]
_ENGINE_POD: list[_Rule] = [
    (r"containers\[0\]\.resources", "spec.{role}.resources", True),
    (r"containers\[0\]\.env", "spec.{role}.env", False),
    (r"containers\[0\]\.(?:command|args)", "spec.{role}.engineArgs", False),
    (r"containers\[0\]\.image(?=$|\.)", "spec.engine.image", True),
    (r"containers\[\d+\]\.imagePullPolicy", "spec.engine.imagePullPolicy", True),
    (r"containers\[1\]\.resources", "spec.kvTransfer.sidecarResources", True),
    (r"containers\[1\]\.image(?=$|\.)", "spec.kvTransfer.sidecarImage", True),
    (r"volumes\[0\]\.emptyDir", "spec.{role}.shmSize", False),
    (r"volumes\[\d+\]\.persistentVolumeClaim", "spec.model.pvc", False),
    (r"imagePullSecrets", "spec.engine.imagePullSecrets", True),
    (r"terminationGracePeriodSeconds", "spec.{role}.terminationGracePeriodSeconds", False),
    *_SCHEDULING,
]
_GATEWAY_POD: list[_Rule] = [
    (r"containers\[0\]\.resources", "spec.gateway.resources", True),
    (r"containers\[0\]\.image(?=$|\.)", "spec.gateway.image", True),
    (r"containers\[0\]\.env", "spec.gateway.apiKeySecret", False),
]
_GATEWAY_SERVICE: list[_Rule] = [
    (r"spec\.type", "spec.gateway.serviceType", False),
    (r"spec\.ports\[0\]\.port", "spec.gateway.port", False),
]


def _match(rules: list[_Rule], path: str, role: str) -> str | None:
    for pattern, field, keep_rest in rules:
        m = re.match(pattern, path)
        if m:
            target = field.format(role=role)
            return target + path[m.end() :] if keep_rest else target
    return None


def cr_field(child: dict[str, Any], field: str) -> str | None:
    """The DeepSeekV4Deployment field that ``field`` of ``child`` comes from, or None when the
    operator alone decides it (then the refusal is the operator's bug, reported as is)."""
    labels = child.get("metadata", {}).get("labels") or {}
    role = labels.get(names.ROLE_LABEL, "")
    kind = child.get("kind")
    if kind == "Service" and role == "gateway":
        return _match(_GATEWAY_SERVICE, field, role)
    pod = _POD_SPEC.match(field)
    if pod is None:
        return None
    rest = field[pod.end() :]
    if role == "gateway":
        return _match(_GATEWAY_POD, rest, role)
    if role in ("prefill", "decode"):
        return _match(_ENGINE_POD, rest, role)
    return None


def refusal(child: dict[str, Any], causes: list[tuple[str, str]], message: str) -> list[str]:
    """One line per cause of the API server's refusal of ``child``, each starting with the CR
    field it came from (``causes``: (field, message) pairs; ``message``: the whole refusal,
    used when the server named no field)."""
    where = f"the API server refused {child['kind']} {child['metadata']['name']}"
    lines = []
    for field, text in causes:
        origin = cr_field(child, field) if field else None
        if origin is not None:
            lines.append(f"{origin}: {text} ({where})")
        else:
            lines.append(f"{where}: {field + ': ' if field else ''}{text}")
    return lines or [f"{where}: {message}"]
