"""What the cluster says about one deployment: engine pod placements, readiness, problems, the KV
token, from its children and engine pods as read (pure: no requests of its own)."""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any

from dsv4_operator.api.spec import ROLES, DeploymentSpec, Role
from dsv4_operator.children import Live
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.desired import Facts
from dsv4_operator.reconcile.identity import LWS_GROUP_INDEX, LWS_WORKER_INDEX, STS_POD_INDEX
from dsv4_operator.reconcile.ranktable import PodPlacement
from dsv4_operator.reconcile.status import Observed
from dsv4_operator.rollout.plan import Slot

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
_BAD_WAITING = {
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "CreateContainerConfigError",
    "InvalidImageName",
}


@dataclass(frozen=True)
class Observation:
    facts: Facts
    """Inputs of ``desired_children``."""
    observed: Observed
    """Inputs of ``compute_status``."""


def _pod_problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when a pod cannot make progress by itself."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            return (
                "Unschedulable",
                f"pod {name} cannot be scheduled: {c.get('message', '')}".strip(),
            )
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _BAD_WAITING:
            return (
                waiting["reason"],
                f"pod {name} container {cs['name']}: {waiting['reason']} {waiting.get('message', '')}".strip(),
            )
    return None


def _placement(pod: dict[str, Any]) -> PodPlacement:
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    return PodPlacement(
        name=meta["name"],
        node_rank=int(
            labels.get(
                STS_POD_INDEX,
                labels.get(LWS_WORKER_INDEX, "0"),
            )
        ),
        node_name=(pod.get("spec") or {}).get("nodeName"),
        host_ip=(pod.get("status") or {}).get("hostIP"),
        devices_annotation=(meta.get("annotations") or {}).get(names.ASCEND_DEVICE_ANNOTATION),
    )


def _instance_of(pod: dict[str, Any]) -> tuple[Role, int] | None:
    labels = pod["metadata"].get("labels") or {}
    role = labels.get(names.ROLE_LABEL)
    idx = labels.get(names.INSTANCE_LABEL, labels.get(LWS_GROUP_INDEX))
    if role not in ROLES or idx is None:
        return None
    return role, int(idx)


def workload_ready(obj: dict[str, Any]) -> bool:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    want = int(spec.get("replicas", 1))
    return (
        status.get("observedGeneration") == obj["metadata"].get("generation")
        and int(status.get("readyReplicas") or 0) >= want
        and int(status.get("updatedReplicas") or 0) >= want
    )


def _slot(obj: dict[str, Any]) -> Slot | None:
    """A StatefulSet as an instance of the rollout: its index, revision and readiness."""
    labels = obj["metadata"].get("labels") or {}
    index = labels.get(names.INSTANCE_LABEL, "")
    if not index.isdigit():
        return None
    return Slot(
        int(index),
        labels.get(names.REVISION_LABEL, ""),
        workload_ready(obj),
        surge=labels.get(names.SURGE_LABEL) == "true",
    )


def _role_of(obj: dict[str, Any]) -> str | None:
    role: str | None = (obj["metadata"].get("labels") or {}).get(names.ROLE_LABEL)
    return role


def _kv_token(secret: dict[str, Any] | None) -> str:
    data = (secret or {}).get("data") or {}
    return base64.b64decode(data["token"]).decode() if data.get("token") else ""


def observe(
    spec: DeploymentSpec, lws_available: bool, live: Live, pods: list[dict[str, Any]]
) -> Observation:
    placements: dict[tuple[Role, int], list[PodPlacement]] = {}
    problems: list[tuple[str, str]] = []
    for pod in pods:
        key = _instance_of(pod)
        if key is not None:
            placements.setdefault(key, []).append(_placement(pod))
        problem = _pod_problem(pod)
        if problem:
            problems.append(problem)

    ready: dict[Role, int] = {r: 0 for r in ROLES}
    slots: dict[Role, list[Slot]] = {r: [] for r in ROLES}
    for (kind, _), obj in live.items():
        role = _role_of(obj)
        if role not in ROLES:
            continue
        if kind == "LeaderWorkerSet" and spec.scheduling.use_lws:
            ready[role] = int((obj.get("status") or {}).get("readyReplicas") or 0)
        elif kind == "StatefulSet" and not spec.scheduling.use_lws:
            slot = _slot(obj)
            if slot is not None:
                slots[role].append(slot)
            ready[role] += workload_ready(obj)

    gw = live.get(("Deployment", names.gateway_name(spec)))
    gateway_ready = int(((gw or {}).get("status") or {}).get("readyReplicas") or 0)
    token = _kv_token(live.get(("Secret", names.kv_secret_name(spec))))
    facts = Facts(
        # the Secret keeps the first token; a fresh one only until it exists
        kv_token=token or secrets.token_urlsafe(32),
        placements=placements,
        lws_available=lws_available,
        slots={r: tuple(sorted(v, key=lambda x: x.index)) for r, v in slots.items()},
    )
    problems.sort(key=lambda p: p[1])
    observed = Observed(
        ready_instances=ready,
        gateway_ready=gateway_ready,
        problems=[m for _, m in problems],
        problem_reason=problems[0][0] if problems else "",
        slots=facts.slots,
    )
    return Observation(facts=facts, observed=observed)
