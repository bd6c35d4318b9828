"""engine.json: the deployment-wide engine settings, one ConfigMap shared by every engine pod.

A flat object whose keys are fields of the engine's ``EngineConfig`` (``dsv4 engine --config``
reads it as such), holding only what the engine reads; the per-role settings (role, parallel
sizes, device, MTP tokens, rank table) are flags on each pod's command line.
"""

from __future__ import annotations

import json
from typing import Any

from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.reconcile import names

ENGINE_CONFIG_KEY = "engine.json"


def engine_config(spec: DeploymentSpec) -> dict[str, Any]:
    m, kv = spec.model, spec.kv
    values: dict[str, Any] = {
        "model": m.engine_model_arg,
        "served_model_name": m.served_name,
        "architecture": m.architecture,
        "dtype": m.dtype,
        "max_model_len": m.max_model_len,
        "kv_sidecar": f"http://127.0.0.1:{kv.control_port}",
        "kv_failure_policy": kv.failure_policy,
        "kv_pull_timeout": kv.pull_timeout_s,
    }
    return {k: v for k, v in values.items() if v is not None}


def engine_configmap(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(
            spec, names.engine_config_name(spec), names.base_labels(spec, "engine")
        ),
        "data": {ENGINE_CONFIG_KEY: json.dumps(engine_config(spec), indent=2, sort_keys=True)},
    }
