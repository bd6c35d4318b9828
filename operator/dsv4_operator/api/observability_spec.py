"""The deployment's ``observability`` section: request traces."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_operator.api.fields import crd_object, prop, section
from dsv4_operator.api.schema import string

OTLP_URL_PATTERN = r"^https?://[^\s/?#]+(/[^\s]*)?$"


@crd_object(defaulted=True, description="OpenTelemetry request traces (docs/tracing.md).")
@dataclass(frozen=True, kw_only=True)
class TracingSpec:
    otlp_endpoint: str | None = prop(
        string(
            "OTLP/HTTP endpoint (an OpenTelemetry collector, Jaeger, ...) that every "
            "engine, KV sidecar and gateway of this deployment sends request traces "
            "to, e.g. http://otel-collector.observability:4318 (/v1/traces is added "
            "when no path is given). Unset: tracing off.",
            pattern=OTLP_URL_PATTERN,
            max_length=512,
        )
    )
    """Request traces (--otlp-traces-endpoint); None: off."""


@crd_object(defaulted=True)
@dataclass(frozen=True, kw_only=True)
class ObservabilitySpec:
    tracing: TracingSpec = section(TracingSpec)
