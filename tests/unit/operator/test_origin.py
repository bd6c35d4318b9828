"""The API server's refusal of a child names the DeepSeekV4Deployment field it came from."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_operator.reconcile.origin import cr_field, refusal


def _child(kind: str, role: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "metadata": {"name": f"v4-{role}", "labels": {"serving.dsv4.io/role": role}},
    }


CASES = [
    (
        "StatefulSet",
        "prefill",
        "spec.template.spec.tolerations[1].effect",
        "spec.scheduling.tolerations[1].effect",
    ),
    ("StatefulSet", "decode", "spec.template.spec.containers[0].env[9].name", "spec.decode.env"),
    (
        "StatefulSet",
        "decode",
        "spec.template.spec.containers[0].resources.limits[cpu]",
        "spec.decode.resources.limits[cpu]",
    ),
    (
        "StatefulSet",
        "prefill",
        "spec.template.spec.containers[1].resources.requests",
        "spec.kvTransfer.sidecarResources.requests",
    ),
    (
        "StatefulSet",
        "prefill",
        "spec.template.spec.containers[1].image",
        "spec.kvTransfer.sidecarImage",
    ),
    (
        "StatefulSet",
        "prefill",
        "spec.template.spec.volumes[0].emptyDir.sizeLimit",
        "spec.prefill.shmSize",
    ),
    (
        "StatefulSet",
        "prefill",
        "spec.template.spec.priorityClassName",
        "spec.scheduling.priorityClassName",
    ),
    (
        "LeaderWorkerSet",
        "prefill",
        "spec.leaderWorkerTemplate.workerTemplate.spec.affinity.nodeAffinity",
        "spec.scheduling.affinity.nodeAffinity",
    ),
    ("Deployment", "gateway", "spec.template.spec.containers[0].image", "spec.gateway.image"),
    (
        "Deployment",
        "gateway",
        "spec.template.spec.containers[0].env[0].valueFrom.secretKeyRef.name",
        "spec.gateway.apiKeySecret",
    ),
    ("Service", "gateway", "spec.type", "spec.gateway.serviceType"),
    # what the operator alone decides names no field of the deployment
    ("StatefulSet", "prefill", "spec.serviceName", None),
    ("StatefulSet", "prefill", "spec.template.spec.containers[0].imageID", None),
    ("Service", "prefill", "spec.clusterIP", None),
]


@pytest.mark.parametrize(("kind", "role", "field", "expected"), CASES)
def test_a_child_field_maps_to_the_field_it_was_rendered_from(
    kind: str, role: str, field: str, expected: str | None
) -> None:
    assert cr_field(_child(kind, role), field) == expected


def test_a_refusal_reads_one_line_per_cause() -> None:
    child = _child("StatefulSet", "prefill")
    causes = [
        ("spec.template.spec.tolerations[0].operator", 'Unsupported value: "X"'),
        ("spec.serviceName", "Invalid value"),
    ]
    assert refusal(child, causes, "whole") == [
        'spec.scheduling.tolerations[0].operator: Unsupported value: "X" '
        "(the API server refused StatefulSet v4-prefill)",
        "the API server refused StatefulSet v4-prefill: spec.serviceName: Invalid value",
    ]
    assert refusal(child, [], "quota exceeded") == [
        "the API server refused StatefulSet v4-prefill: quota exceeded"
    ]


def test_the_positions_origin_relies_on_are_those_the_operator_renders(npu_spec: Any) -> None:
    from dsv4_operator.reconcile import Facts, desired_children

    for obj in desired_children(npu_spec, Facts(kv_token="t")):
        if obj["kind"] == "StatefulSet":
            pod = obj["spec"]["template"]["spec"]
            assert [c["name"] for c in pod["containers"]] == ["engine", "kv-sidecar"]
            assert pod["volumes"][0]["name"] == "shm"
        if obj["kind"] == "Deployment":
            [gateway] = obj["spec"]["template"]["spec"]["containers"]
            assert [e["name"] for e in gateway["env"]] in ([], ["DSV4_GATEWAY_API_KEY"])
