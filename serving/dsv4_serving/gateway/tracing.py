"""The gateway's spans (tracing on): one SERVER span per request, the root of its trace or a
child of the client's ``traceparent``, and one CLIENT span per upstream attempt (prefill,
decode) with the routing decision: policy, chosen instance and DP rank, attempt number. The
attempt's context goes upstream as ``traceparent``; the request's ``X-Request-Id`` is an
attribute of the request span (``dsv4 trace <id>`` finds the trace by it).

The spans are ``dsv4_common.light_spans`` records, not the OpenTelemetry SDK's (whose cost on the
event loop was most of the gateway's tracing overhead; docs/tracing.md, "Figures"). The request
span is the current one (a contextvar) while the request is routed, so the attempts made under
it are its children without being passed it; it ends when the request's ticket closes (for a
stream: when the stream ends), and so does a streamed decode attempt (it moves to the ticket
with the upstream response)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from types import TracebackType
from typing import Any

from dsv4_common import light_spans, tracing
from dsv4_common.light_spans import Recorder, Span
from dsv4_serving.gateway.policies import Choice

SERVICE = "dsv4-gateway"
_current: ContextVar[Span | None] = ContextVar("dsv4_gateway_span", default=None)


def setup(endpoint: str | None) -> Recorder | None:
    """The gateway's span recorder, or None (tracing off: nothing made, nothing imported)."""
    return light_spans.setup(endpoint, SERVICE)


def flush() -> None:
    light_spans.flush()


@contextmanager
def request_span(
    recorder: Recorder,
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
    span = recorder.start(
        f"{operation} {model}".strip(),
        light_spans.parse_traceparent(headers.get(tracing.TRACEPARENT)),
        attrs,
        "server",
    )
    try:
        yield span
    finally:
        result = outcome() or "error"
        span.attributes["dsv4.gateway.outcome"] = result
        if result == "error":
            span.fail("the request failed")
        span.end()


@contextmanager
def routing(span: Span) -> Iterator[None]:
    """``span`` is the parent of the spans started in this block (and in tasks it creates)."""
    token = _current.set(span)
    try:
        yield
    finally:
        _current.reset(token)


def current_span() -> Span | None:
    """The request span of the routing block this runs in (None: tracing off or outside)."""
    return _current.get()


def routing_under(span: Span | None) -> Any:
    """``routing(span)``, or nothing when ``span`` is None (tracing off)."""
    return nullcontext() if span is None else routing(span)


class _Attempt:
    """``with``: one upstream attempt's span under the current request span; an exception
    leaving the block marks it failed."""

    __slots__ = ("attributes", "name", "recorder", "span")

    def __init__(self, recorder: Recorder, name: str, attributes: dict[str, Any]) -> None:
        self.recorder, self.name, self.attributes = recorder, name, attributes

    def __enter__(self) -> Span:
        self.span = self.recorder.start(self.name, _current.get(), self.attributes, "client")
        return self.span

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if e is not None:
            self.span.fail(f"{kind.__name__ if kind else ''}: {e}")
        self.span.end()


def attempt_span(
    recorder: Recorder | None, role: str, choice: Choice, attempt: int, policy: str
) -> Any:
    """A context manager: the span of one upstream attempt (None when tracing is off)."""
    if recorder is None:
        return nullcontext()
    return _Attempt(
        recorder,
        f"dsv4.gateway.{role}",
        {
            "dsv4.role": role,
            "dsv4.gateway.policy": policy,
            "dsv4.gateway.attempt": attempt,  # > 0: a retry
            "server.address": choice.instance.url,
            "dsv4.dp_rank": choice.rank,
            "dsv4.gateway.predicted_cached_tokens": choice.cached_tokens,
        },
    )


def upstream_status(span: Span | None, status: int) -> None:
    if span is not None:
        span.attributes["http.response.status_code"] = status
        if status >= 500:
            span.fail(f"upstream answered {status}")
