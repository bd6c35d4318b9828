"""A deployment's revision: the hash of everything an engine pod runs (both roles' pod
templates: image, engine flags, resources, env; and engine.json: the model). One revision spans
both roles, as LWS's DisaggregatedSet does: prefill and decode of one revision are known to
exchange KV, so the gateway pairs them only within a revision, and any change rolls both."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dsv4_operator.api.spec import ROLES, DeploymentSpec
from dsv4_operator.reconcile.engine_config import engine_configmap
from dsv4_operator.reconcile.engine_pod import pod_template
from dsv4_operator.reconcile.identity import StatefulSetIdentity

LENGTH = 10


def revision(spec: DeploymentSpec) -> str:
    """10 hex digits; the same for every spec that renders the same engine pods (the instance
    count, the gateway, autoscaling bounds do not enter)."""
    parts: dict[str, Any] = {
        # instance 0's template: what differs between instances is their index, not the spec
        r: pod_template(spec, spec.role(r), StatefulSetIdentity(0))
        for r in ROLES
    }
    parts["engine.json"] = engine_configmap(spec)["data"]
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return digest[:LENGTH]
