"""engine.json: the deployment-wide engine settings, one ConfigMap shared by every engine pod.

A flat object whose keys are fields of the engine's ``EngineConfig`` (``dsv4 engine --config``
reads it as such), holding only what the engine reads; the per-role settings (role, parallel
sizes, device, MTP tokens, rank table) are flags on each pod's command line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dsv4_common.ports import KV_EVENTS_PORT
from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.reconcile import names

ENGINE_CONFIG_KEY = "engine.json"
KV_SIDECAR_WAIT_S = 120
"""How long an engine waits at start for its pod's KV sidecar (the engine's own default, 10 s,
suits a sidecar started first by hand): the two containers start together, and on a busy node
the sidecar can take longer than that to answer, which made the engine exit and be restarted."""


def _eplb(spec: DeploymentSpec, value: int) -> int | None:
    return value if spec.features.eplb.enabled else None


# engine.json's keys (EngineConfig fields) and how each is read from the deployment.
_FIELDS: dict[str, Callable[[DeploymentSpec], Any]] = {
    "model": lambda s: s.model.engine_model_arg,
    "served_model_name": lambda s: s.model.served_name,
    "architecture": lambda s: s.model.architecture,
    "dtype": lambda s: s.model.dtype,
    "quantization": lambda s: s.model.quantization,
    "max_model_len": lambda s: s.model.max_model_len,
    "kv_sidecar": lambda s: f"http://127.0.0.1:{s.kv.control_port}",
    "kv_failure_policy": lambda s: s.kv.failure_policy,
    "kv_pull_timeout": lambda s: s.kv.pull_timeout_s,
    "kv_sidecar_wait": lambda s: KV_SIDECAR_WAIT_S,
    # KV events for the gateway's precise prefix index (DP rank r: this port + 2r, + 2r + 1)
    "kv_events_endpoint": lambda s: f"tcp://0.0.0.0:{KV_EVENTS_PORT}",
    # EPLB: only when enabled (the engine's defaults otherwise; the CRD keeps both roles EP > 1)
    "enable_eplb": lambda s: True if s.features.eplb.enabled else None,
    "eplb_redundant_experts": lambda s: _eplb(s, s.features.eplb.redundant_experts),
    "eplb_interval": lambda s: _eplb(s, s.features.eplb.interval_steps),
    "eplb_window": lambda s: _eplb(s, s.features.eplb.window_steps),
    # request tracing: only when the deployment turns it on (spec.observability.tracing)
    "otlp_traces_endpoint": lambda s: s.observability.tracing.otlp_endpoint,
}
ENGINE_CONFIG_FIELDS = tuple(_FIELDS)
"""Every key engine.json may hold: settings the operator owns (``engineArgs`` may not repeat
them as flags)."""


def engine_config(spec: DeploymentSpec) -> dict[str, Any]:
    values = {key: read(spec) for key, read in _FIELDS.items()}
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
