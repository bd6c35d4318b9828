"""The DeepSeekV4Deployment CRD, built in code: the one source of truth for manifests/ and the chart.

Structural schema with defaults (so the operator sees a complete spec), CEL rules for checks that
span fields (messages written for the person who made the mistake), a status subresource and
printer columns. The spec's fields are declared in ``api.spec`` (each once, with its schema).
``scripts/gen-manifests`` writes it out; a test fails if the copies drift.
"""

from __future__ import annotations

from typing import Any

from dsv4_operator.api import GROUP, KIND, PLURAL, SHORT_NAME, SINGULAR, VERSION
from dsv4_operator.api.schema import obj
from dsv4_operator.api.spec import spec_schema
from dsv4_operator.api.status_schema import printer_columns, status_schema

MAX_NAME = 40  # children append "-prefill-NN-ranktable"; pod names must stay DNS labels (63)

_NAME_RULE = (
    f"self.metadata.name.size() <= {MAX_NAME} && "
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    f"metadata.name must be a DNS label of at most {MAX_NAME} characters starting with a letter "
    "(it prefixes the names of the Services and pods the operator creates)",
)


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object, as applied to a cluster."""
    root = obj(
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        required=["spec"],
        rules=[_NAME_RULE],
        description="A DeepSeek V4 (or V3) deployment with disaggregated prefill and decode on Ascend NPUs.",
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "dsv4", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
                "categories": ["all", "dsv4"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }
