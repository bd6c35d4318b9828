"""The engine API server's span of one request (tracing on): a SERVER span, child of the
caller's ``traceparent`` (the gateway's attempt, or a client's), named as the GenAI semantic
conventions name an inference (``{operation} {model}``). Its context goes to the engine core
with the request; the core's spans (queue, prefill chunks, KV, decode) are its children."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dsv4_common import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

REQUEST_ID_HEADER = "x-request-id"


def start_request_span(
    tracer: Tracer,
    headers: Mapping[str, str],
    chat: bool,
    model: str,
    role: str,
    prompt_tokens: int,
    max_tokens: int | None,
    start_ns: int,
) -> Span:
    operation = "chat" if chat else "text_completion"
    attrs: dict[str, Any] = {
        tracing.GEN_AI_OPERATION: operation,
        tracing.GEN_AI_MODEL: model,
        tracing.GEN_AI_INPUT_TOKENS: prompt_tokens,
        "dsv4.role": role,
    }
    if max_tokens is not None:
        attrs[tracing.GEN_AI_MAX_TOKENS] = max_tokens
    rid = headers.get(REQUEST_ID_HEADER)
    if rid:
        attrs[tracing.REQUEST_ID] = rid
    return tracing.start(
        tracer,
        f"{operation} {model}",
        tracing.extract(headers),
        attrs,
        span_kind="server",
        start_ns=start_ns,
    )


def answered(span: Span, body: Mapping[str, Any]) -> None:
    """What a whole (non-streamed) answer says: id, usage, finish reasons."""
    usage = body.get("usage") or {}
    span.set_attributes(
        {
            tracing.GEN_AI_RESPONSE_ID: str(body.get("id", "")),
            tracing.GEN_AI_INPUT_TOKENS: int(usage.get("prompt_tokens", 0)),
            tracing.GEN_AI_OUTPUT_TOKENS: int(usage.get("completion_tokens", 0)),
            tracing.GEN_AI_FINISH: [str(c.get("finish_reason")) for c in body.get("choices", [])],
            "dsv4.prefix_cache.hit_tokens": int(
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            ),
        }
    )
