"""What both DeepSeek encoders read from OpenAI-shaped messages, and the options of one render."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = Mapping[str, Any]


class ChatFormatError(ValueError):
    """A conversation the chat format cannot render (the API answers 400 with this message)."""


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    """One render's switches (see ``switches.py`` for how a request sets them).

    ``effort`` is a tier of the checkpoint's effort table ("low", "high", "max"), or None for the
    table's default; it only applies in thinking mode. ``tools`` are OpenAI tool objects
    (``{"type": "function", "function": {...}}``); ``response_format`` is rendered as given.
    """

    thinking: bool = True
    effort: str | None = None
    tools: Sequence[Mapping[str, Any]] = ()
    response_format: Mapping[str, Any] | None = None
    drop_thinking: bool = True


@dataclass(frozen=True, slots=True)
class CallSpec:
    """An assistant's tool call as the encoder writes it back."""

    id: str
    name: str
    arguments: dict[str, Any]


def text_of(content: Any, what: str) -> str:
    """A message's content as text: a string, None, or OpenAI content parts.

    Text parts are joined by ``\\n\\n``; any other part becomes ``[Unsupported <type>]`` (what
    DeepSeek's encoder writes for a tool result's non-text part).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(_part_text(p, what) for p in content)
    raise ChatFormatError(f"{what}: content must be a string or a list of parts")


def _part_text(part: Any, what: str) -> str:
    if not isinstance(part, Mapping):
        raise ChatFormatError(f"{what}: each content part must be an object")
    if part.get("type") == "text":
        return str(part.get("text", ""))
    return f"[Unsupported {part.get('type')}]"


def reasoning_of(msg: Message) -> str:
    """An assistant's earlier reasoning: DeepSeek's ``reasoning_content`` or vLLM's ``reasoning``."""
    value = msg.get("reasoning_content") or msg.get("reasoning") or ""
    return str(value)


def tool_calls_of(msg: Message, where: str) -> list[CallSpec]:
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}.tool_calls must be a list")
    return [_call_spec(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]


def _call_spec(call: Any, where: str) -> CallSpec:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ChatFormatError(f"{where}.function.name is missing")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise ChatFormatError(f"{where}.function.arguments is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where}.function.arguments must be a JSON object")
    return CallSpec(id=str(call.get("id") or ""), name=fn["name"], arguments=args)


def tool_functions(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ``function`` objects of OpenAI tools, in the client's order and key order."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping):
            raise ChatFormatError(f"tools[{i}].function is missing")
        out.append(fn)
    return out


def with_system_extras(messages: Sequence[Message], opts: EncodeOptions) -> list[dict[str, Any]]:
    """Copies of ``messages`` with the request's tools and response format on the first system
    message (an empty one is put first when there is none), where DeepSeek renders them."""
    out = [dict(m) for m in messages]
    if not opts.tools and opts.response_format is None:
        return out
    first = next((i for i, m in enumerate(out) if m.get("role") == "system"), None)
    if first is None:
        out.insert(0, {"role": "system", "content": ""})
        first = 0
    out[first]["tools"] = list(opts.tools)
    out[first]["response_format"] = opts.response_format
    return out


def last_user_index(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def drop_earlier_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user turn: assistants lose their reasoning, developer messages go."""
    last = last_user_index(messages)
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if i >= last or role in ("user", "system", "tool"):
            out.append(msg)
        elif role == "assistant":
            kept = {k: v for k, v in msg.items() if k not in ("reasoning", "reasoning_content")}
            out.append(kept)
    return out
