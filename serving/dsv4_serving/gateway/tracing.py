"""The gateway's spans (tracing on): one SERVER span per request, the root of its trace or a
child of the client's ``traceparent``, and one CLIENT span per upstream attempt (prefill,
decode) with the routing decision: policy, chosen instance and DP rank, attempt number. The
attempt's context goes upstream as ``traceparent``; the request's ``X-Request-Id`` is an
attribute of the request span (``dsv4 trace <id>`` finds the trace by it).

The request span is made current (OpenTelemetry's context, a contextvar) while the request is
routed, so the attempts made under it are its children without being passed it; it ends when
the request's ticket closes (for a stream: when the stream ends), and so does a streamed
decode attempt (it moves to the ticket with the upstream response)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from dsv4_common import tracing
from dsv4_serving.gateway.policies import Choice

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer


@contextmanager
def request_span(
    tracer: Tracer,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    chat: bool,
    request_id: str,
    outcome: Callable[[], str | None],
) -> Iterator[Span]:
    """The request's span, ended at the close of the ticket that holds this context manager
    (``outcome``: the ticket's, read then)."""
    operation = "chat" if chat else "text_completion"
    model = str(body.get("model") or "")
    attrs: dict[str, Any] = {
        tracing.GEN_AI_OPERATION: operation,
        tracing.GEN_AI_MODEL: model,
        tracing.REQUEST_ID: request_id,
        "dsv4.stream": bool(body.get("stream")),
    }
    if isinstance(body.get("max_tokens"), int):
        attrs[tracing.GEN_AI_MAX_TOKENS] = body["max_tokens"]
    span = tracing.start(
        tracer, f"{operation} {model}".strip(), tracing.extract(headers), attrs, "server"
    )
    try:
        yield span
    finally:
        result = outcome() or "error"
        span.set_attribute("dsv4.gateway.outcome", result)
        if result == "error":
            tracing.fail(span, "the request failed")
        span.end()


@contextmanager
def routing(span: Span) -> Iterator[None]:
    """``span`` is the parent of the spans started in this block (and in tasks it creates)."""
    from opentelemetry import context

    token = context.attach(tracing.parent_of(span))
    try:
        yield
    finally:
        context.detach(token)


def attempt_span(
    tracer: Tracer | None, role: str, choice: Choice, attempt: int, policy: str
) -> Any:
    """A context manager: the span of one upstream attempt (None when tracing is off)."""
    if tracer is None:
        return tracing.span(None, "")
    inst = choice.instance
    return tracing.span(
        tracer,
        f"dsv4.gateway.{role}",
        None,  # the current context: the request's span
        {
            "dsv4.role": role,
            "dsv4.gateway.policy": policy,
            "dsv4.gateway.attempt": attempt,  # > 0: a retry
            "server.address": inst.url,
            "dsv4.dp_rank": choice.rank,
            "dsv4.gateway.predicted_cached_tokens": choice.cached_tokens,
        },
        "client",
    )


def upstream_status(span: Span | None, status: int) -> None:
    if span is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            tracing.fail(span, f"upstream answered {status}")
