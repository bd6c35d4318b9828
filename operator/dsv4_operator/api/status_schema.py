"""The CRD's status subresource and the printer columns ``kubectl get dsv4`` shows."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.schema import (
    Schema,
    integer,
    obj,
    string,
    string_list,
)


def _role_status() -> Schema:
    return obj(
        {
            "desired": integer("Instances wanted."),
            "ready": integer("Instances whose every pod is ready."),
            "summary": string("ready/desired, for kubectl get."),
            "updated": integer("Ready instances running the current revision."),
            "old": integer("Instances still running an earlier revision (a rollout is on)."),
            "draining": string_list(
                "Instances being drained before deletion (autoscaler scale-down): the gateway "
                "routes them no new requests."
            ),
        }
    )


def status_schema() -> Schema:
    condition = obj(
        {
            "type": string(
                "Ready, Progressing, Degraded, RolledOut, AutoscalingActive or ScalingLimited."
            ),
            "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": string("CamelCase reason."),
            "message": string("Human-readable detail."),
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
        required=["type", "status"],
    )
    return obj(
        {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "phase": string("Pending, Progressing, Ready or Degraded."),
            "revision": string(
                "The spec's revision: the hash of what engine pods run (model, image, engine "
                "flags); pods carry it as serving.dsv4.io/revision."
            ),
            "updated": string(
                "Ready instances at the current revision / instances wanted, both roles."
            ),
            "prefill": _role_status(),
            "decode": _role_status(),
            "gateway": obj(
                {
                    "endpoint": string("In-cluster URL of the gateway."),
                    "ready": integer("Ready gateway replicas."),
                }
            ),
            "autoscaling": {
                "type": "object",
                "description": "What the autoscaler saw and decided (per role: current, "
                "recommended, target, reason, draining, signals).",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "metrics": obj(
                {
                    "ttft": string("p90 time to first token over the autoscaler's window."),
                    "tpot": string("p90 time per output token over the autoscaler's window."),
                }
            ),
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        },
        description="Observed state, written by the operator.",
    )


def printer_columns() -> list[dict[str, Any]]:
    return [
        {
            "name": "Prefill",
            "type": "string",
            "jsonPath": ".status.prefill.summary",
            "description": "ready/desired prefill instances",
        },
        {
            "name": "Decode",
            "type": "string",
            "jsonPath": ".status.decode.summary",
            "description": "ready/desired decode instances",
        },
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {
            "name": "Updated",
            "type": "string",
            "jsonPath": ".status.updated",
            "description": "ready instances at the current revision / instances wanted",
        },
        {
            "name": "Revision",
            "type": "string",
            "jsonPath": ".status.revision",
            "description": "the revision engine pods are rolled to",
            "priority": 1,
        },
        {
            "name": "TTFT",
            "type": "string",
            "jsonPath": ".status.metrics.ttft",
            "description": "p90 time to first token (autoscaler window)",
        },
        {
            "name": "TPOT",
            "type": "string",
            "jsonPath": ".status.metrics.tpot",
            "description": "p90 time per output token (autoscaler window)",
        },
        {
            "name": "Scaling",
            "type": "string",
            "jsonPath": ".status.autoscaling.lastDecision",
            "description": "the autoscaler's last decision",
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
