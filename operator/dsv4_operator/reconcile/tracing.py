"""``spec.observability.tracing`` on the containers: the KV sidecars and the gateway get
``--otlp-traces-endpoint`` on their command line, the engines the same setting as an engine.json
key (``engine_config``: the engine's flags and its config file are one set of fields)."""

from __future__ import annotations

from dsv4_operator.api.spec import DeploymentSpec


def tracing_args(spec: DeploymentSpec) -> list[str]:
    endpoint = spec.observability.tracing.otlp_endpoint
    return ["--otlp-traces-endpoint", endpoint] if endpoint else []
