"""OpenAI shapes of the parser's output: stream deltas, the final message, the finish reason.

Pure functions so that the HTTP wiring stays thin. A call's first delta carries ``index``, ``id``,
``type``, ``name`` and ``""`` arguments, once; later deltas carry ``index`` and argument
fragments only (clients break when ids repeat in every chunk).
"""

from __future__ import annotations

from typing import Any

from dsv4_serving.chat.output_parser import (
    Content,
    Event,
    ParsedMessage,
    Reasoning,
    ToolArgs,
    ToolEnd,
    ToolStart,
)


def reasoning_delta(text: str) -> dict[str, Any]:
    return {"reasoning_content": text}


def content_delta(text: str) -> dict[str, Any]:
    return {"content": text}


def tool_start_delta(index: int, call_id: str, name: str) -> dict[str, Any]:
    call = {"index": index, "id": call_id, "type": "function"}
    return {"tool_calls": [{**call, "function": {"name": name, "arguments": ""}}]}


def tool_args_delta(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def event_delta(event: Event) -> dict[str, Any] | None:
    """The ``choices[].delta`` for one event; None for an event with nothing to send."""
    if isinstance(event, Reasoning):
        return reasoning_delta(event.text)
    if isinstance(event, Content):
        return content_delta(event.text)
    if isinstance(event, ToolStart):
        return tool_start_delta(event.index, event.id, event.name)
    if isinstance(event, ToolArgs):
        return tool_args_delta(event.index, event.text) if event.text else None
    if isinstance(event, ToolEnd):
        return None
    raise TypeError(f"not a parser event: {event!r}")


def message(parsed: ParsedMessage) -> dict[str, Any]:
    """The non-streamed ``choices[].message``: ``content`` is null when the model only called
    tools; ``reasoning_content`` is null when there was no reasoning."""
    out: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content if parsed.content or not parsed.tool_calls else None,
        "reasoning_content": parsed.reasoning or None,
    }
    if parsed.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return out


def finish_reason(parsed: ParsedMessage, engine_reason: str | None) -> str | None:
    """``tool_calls`` when the model stopped after calling tools; the engine's reason otherwise
    (a completion cut by ``length`` stays ``length``, whatever it holds)."""
    if engine_reason == "stop" and parsed.tool_calls:
        return "tool_calls"
    return engine_reason
