"""Request tracing with OpenTelemetry, shared by every component (gateway, engine, KV sidecar).

Off by default. ``setup(endpoint, service)`` returns ``None`` when no ``--otlp-traces-endpoint``
is given, and every caller keeps that ``None`` as its whole tracing state: a component with
tracing off tests ``tracer is None`` once per request and creates no span, context or header
(the SDK is not even imported). On, spans go to an OTLP/HTTP (protobuf) endpoint through a
``BatchSpanProcessor`` (export on a background thread, never in the request path).

Context crosses processes as a W3C ``traceparent`` (``inject``/``extract``): an HTTP header
between gateway, engines and sidecars, a plain string inside the engine's own messages.
Spans of work whose start is known only afterwards (a pull measured by its thread, a lease
ended by a peer) are recorded with explicit times (``record``).

Names follow the OpenTelemetry GenAI semantic conventions where they define one
(``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ...); ours are ``dsv4.*``.

The gateway records its spans with ``light_spans`` instead (no SDK object on its event loop);
the engines and sidecars use this module.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanKind, Tracer

TRACEPARENT = "traceparent"
TRACES_PATH = "/v1/traces"

# attribute names (GenAI semantic conventions, then ours)
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.provider.name"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
MAX_QUEUED_SPANS = 16384
REQUEST_ID = "dsv4.request_id"  # the gateway's X-Request-Id: how `dsv4 trace` finds a trace

_lock = threading.Lock()
_providers: dict[tuple[str, str], Any] = {}


class TracingConfigError(ValueError):
    pass


def traces_url(endpoint: str) -> str:
    """``http://host:4318`` or ``http://host:4318/v1/traces`` -> the OTLP/HTTP traces URL."""
    u = urlsplit(endpoint)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise TracingConfigError(
            f"--otlp-traces-endpoint must be an http:// or https:// URL, got {endpoint!r}"
        )
    return endpoint if u.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


def check_endpoint(endpoint: str | None) -> None:
    """For configs' ``__post_init__``: a bad endpoint is an error at start, not a silent drop."""
    if endpoint is not None:
        traces_url(endpoint)


def setup(
    endpoint: str | None, service: str, attributes: Mapping[str, Any] | None = None
) -> Tracer | None:
    """A tracer exporting to ``endpoint`` as ``service`` (``service.name``), or ``None`` when
    ``endpoint`` is ``None`` (tracing off). One provider per (endpoint, service) per process,
    flushed at exit."""
    if endpoint is None:
        return None
    url = traces_url(endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    with _lock:
        provider = _providers.get((url, service))
        if provider is None:
            resource = Resource.create({"service.name": service, **(attributes or {})})
            provider = TracerProvider(resource=resource)
            # short batches (a trace is wanted seconds after its request, not at a 5 s tick) and
            # room for a few seconds of spans of a busy gateway before any is dropped
            provider.add_span_processor(
                BatchSpanProcessor(
                    OTLPSpanExporter(endpoint=url),
                    schedule_delay_millis=500,
                    max_queue_size=MAX_QUEUED_SPANS,
                )
            )
            _providers[(url, service)] = provider
            atexit.register(provider.shutdown)
    tracer: Tracer = provider.get_tracer("dsv4")
    return tracer


def flush(timeout_s: float = 5.0) -> None:
    """Export what is batched now (before a process exits on a signal)."""
    with _lock:
        providers = list(_providers.values())
    for p in providers:
        p.force_flush(int(timeout_s * 1000))


def extract(headers: Mapping[str, str]) -> Context | None:
    """The parent context a ``traceparent`` header names (None: no valid one, start a trace)."""
    value = headers.get(TRACEPARENT)
    return from_traceparent(value) if value else None


def from_traceparent(value: str | None) -> Context | None:
    if not value:
        return None
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({TRACEPARENT: value})
    return ctx if get_current_span(ctx).get_span_context().is_valid else None


def traceparent(span: Span) -> str:
    """The W3C ``traceparent`` naming ``span`` as the parent of the receiver's spans."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def parent_of(span: Span) -> Context:
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(span)


def kind(name: str) -> SpanKind:
    from opentelemetry.trace import SpanKind

    return SpanKind[name.upper()]


def start(
    tracer: Tracer,
    name: str,
    parent: Context | None,
    attributes: Mapping[str, Any] | None = None,
    span_kind: str = "internal",
    start_ns: int | None = None,
) -> Span:
    """A live span (the caller ends it); ``parent`` None starts a new trace."""
    return tracer.start_span(
        name,
        context=parent,
        kind=kind(span_kind),
        attributes=dict(attributes or {}),
        start_time=start_ns,
    )


def record(
    tracer: Tracer,
    name: str,
    parent: Context | None,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
    span_kind: str = "internal",
    error: str | None = None,
) -> Span:
    """A span of work measured elsewhere: started and ended at the given times (ns since the
    epoch, ``time.time_ns()``)."""
    span = start(tracer, name, parent, attributes, span_kind, start_ns)
    if error is not None:
        fail(span, error)
    span.end(end_time=max(end_ns, start_ns))
    return span


def fail(span: Span, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, message))


@contextmanager
def span(
    tracer: Tracer | None,
    name: str,
    parent: Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    span_kind: str = "internal",
) -> Iterator[Span | None]:
    """``with span(tracer, ...) as s``: a span for the block (None, and nothing made, when
    ``tracer`` is None); an exception leaving the block marks it failed."""
    if tracer is None:
        yield None
        return
    s = start(tracer, name, parent, attributes, span_kind)
    try:
        yield s
    except BaseException as e:
        fail(s, f"{type(e).__name__}: {e}")
        raise
    finally:
        s.end()


def now_ns() -> int:
    return time.time_ns()
