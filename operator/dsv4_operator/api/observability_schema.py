"""The CRD's ``spec.observability`` schema: request tracing for the whole deployment."""

from __future__ import annotations

from dsv4_operator.api.schema import Schema, obj, string

OTLP_URL_PATTERN = r"^https?://[^\s/?#]+(/[^\s]*)?$"


def observability_schema() -> Schema:
    return obj(
        {
            "tracing": obj(
                {
                    "otlpEndpoint": string(
                        "OTLP/HTTP endpoint (an OpenTelemetry collector, Jaeger, ...) that every "
                        "engine, KV sidecar and gateway of this deployment sends request traces "
                        "to, e.g. http://otel-collector.observability:4318 (/v1/traces is added "
                        "when no path is given). Unset: tracing off.",
                        pattern=OTLP_URL_PATTERN,
                        max_length=512,
                    ),
                },
                default={},
                description="OpenTelemetry request traces (docs/tracing.md).",
            ),
        },
        default={},
    )
