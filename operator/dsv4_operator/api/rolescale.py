"""``DeepSeekV4RoleScale``: one per role of a deployment with ``autoscaling.mode: External``,
named ``{deployment}-{role}``, with a ``scale`` subresource, so an HPA or KEDA ScaledObject can
drive that role's instance count. The operator reads ``spec.replicas`` as the target, clamps it
to the role's min/max and drains instances before removing them; it writes ``status.replicas``
(instances serving or starting) and ``status.selector`` (the role's rank-0 engine pods, one per
instance, whose metrics an HPA averages)."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api import GROUP, VERSION
from dsv4_operator.api.schema import integer, obj, string

ROLE_SCALE_KIND = "DeepSeekV4RoleScale"
ROLE_SCALE_PLURAL = "deepseekv4rolescales"


def role_scale_crd() -> dict[str, Any]:
    root = obj(
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": obj(
                {
                    "replicas": integer(
                        "Instances wanted (set by an HPA/KEDA through the scale subresource; "
                        "clamped to the deployment's autoscaling min/max).",
                        minimum=0,
                        maximum=512,
                    )
                }
            ),
            "status": obj(
                {
                    "replicas": integer("Instances serving or starting."),
                    "selector": string("Label selector of the role's rank-0 engine pods."),
                }
            ),
        },
        description="The instance count of one role of a DeepSeekV4Deployment, for external "
        "autoscalers (autoscaling.mode External).",
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{ROLE_SCALE_PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "dsv4", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": ROLE_SCALE_KIND,
                "listKind": f"{ROLE_SCALE_KIND}List",
                "plural": ROLE_SCALE_PLURAL,
                "singular": ROLE_SCALE_KIND.lower(),
                "shortNames": ["dsv4rs"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Wanted", "type": "integer", "jsonPath": ".spec.replicas"},
                        {"name": "Current", "type": "integer", "jsonPath": ".status.replicas"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }
