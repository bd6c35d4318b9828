"""DeepSeek V4's chat format: OpenAI-shaped messages -> the prompt text the model was trained on.

Written from the format DeepSeek publishes with the checkpoint (``encoding/encoding_dsv4.py``),
byte for byte; ``docs/agent-api.md`` describes it. The internal roles and task tokens of that
encoder (``latest_reminder``, ``<｜action｜>``, ...) are not part of the API and are refused.
"""

# DeepSeek's markers are spelled with U+FF5C, not an ASCII bar
# ruff: noqa: RUF002

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsv4_serving.chat import dsml
from dsv4_serving.chat.effort import V4_0731, EffortTable
from dsv4_serving.chat.messages import (
    ChatFormatError,
    EncodeOptions,
    Message,
    drop_earlier_reasoning,
    last_user_index,
    reasoning_of,
    text_of,
    tool_calls_of,
    tool_functions,
    with_system_extras,
)

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_open}), you MUST output your complete reasoning inside {think_open}...{think_close} BEFORE any tool calls or final response.

Otherwise, output directly after {think_close} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(dsml.to_json(fn) for fn in tool_functions(tools))
    return TOOLS_TEMPLATE.format(
        dsml=dsml.DSML, think_open=dsml.THINK_OPEN, think_close=dsml.THINK_CLOSE, schemas=schemas
    )


def system_extras(msg: Message) -> str:
    """What follows a system (or developer) text: the tools block, then the response format."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format") is not None:
        out += "\n\n" + RESPONSE_FORMAT.format(schema=dsml.to_json(msg["response_format"]))
    return out


def encode(
    messages: Sequence[Message], opts: EncodeOptions, effort_table: EffortTable = V4_0731
) -> str:
    """The whole prompt, from BOS to the open assistant turn."""
    turns = merge_user_turns(with_system_extras(messages, opts))
    # DeepSeek's API wants tool-turn reasoning sent back, so with tools nothing is dropped
    drop = opts.thinking and opts.drop_thinking and not opts.tools
    if drop:
        turns = drop_earlier_reasoning(turns)
    last_user = last_user_index(turns)
    prompt = dsml.BOS
    if opts.thinking and turns:
        prompt += effort_table.prefix(opts.effort)
    for i, msg in enumerate(turns):
        # an assistant turn keeps its reasoning unless it is dropped (before the last user turn)
        keep = opts.thinking and (not drop or i > last_user)
        prompt += render_turn(msg, i, keep)
        prompt += transition(turns, i, opts.thinking, drop, last_user)
    return prompt


def render_turn(msg: Message, index: int, keep_reasoning: bool) -> str:
    role = msg.get("role")
    where = f"messages[{index}]"
    if role == "system":
        return text_of(msg.get("content"), where) + system_extras(msg)
    if role == "developer":
        content = text_of(msg.get("content"), where)
        if not content:
            raise ChatFormatError(f"{where}: a developer message needs content")
        return dsml.USER + content + system_extras(msg)
    if role == "user":
        return dsml.USER + "\n\n".join(msg["parts"])
    if role == "assistant":
        return render_assistant(msg, where, keep_reasoning)
    raise ChatFormatError(f"{where}: role {role!r} is not supported")


def render_assistant(msg: Message, where: str, with_reasoning: bool) -> str:
    """``{reasoning}</think>`` (thinking mode, kept turns) + content + calls + EOS."""
    head = reasoning_of(msg) + dsml.THINK_CLOSE if with_reasoning else ""
    calls = tool_calls_of(msg, where)
    block = ""
    if calls:
        invokes = [dsml.render_invoke(c.name, c.arguments) for c in calls]
        block = "\n\n" + dsml.render_block(dsml.V4_BLOCK, invokes)
    return head + text_of(msg.get("content"), where) + block + dsml.EOS


def transition(turns: Sequence[Message], i: int, thinking: bool, drop: bool, last: int) -> str:
    """After a user turn that the assistant answers next: open its turn, thinking or not."""
    if turns[i].get("role") not in ("user", "developer"):
        return ""
    if i + 1 < len(turns) and turns[i + 1].get("role") != "assistant":
        return ""
    opens = thinking and (not drop or i >= last)
    return dsml.ASSISTANT + (dsml.THINK_OPEN if opens else dsml.THINK_CLOSE)


def merge_user_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """User and ``tool`` messages in a row become one user turn of parts joined by ``\\n\\n``;
    tool results in the order of the previous assistant's calls (V4 has no tool role).
    """
    out: list[dict[str, Any]] = []
    order: dict[str, int] = {}
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "assistant":
            order = {c.id: k for k, c in enumerate(tool_calls_of(msg, f"messages[{i}]")) if c.id}
        if role not in ("user", "tool"):
            out.append(msg)
            continue
        part = _user_part(msg, i)
        if out and out[-1].get("role") == "user":
            out[-1]["items"].append(part)
        else:
            out.append({"role": "user", "items": [part], "order": order})
    for turn in out:
        if turn.get("role") == "user":
            turn["parts"] = _ordered_parts(turn.pop("items"), turn.pop("order"))
    return out


def _user_part(msg: Message, i: int) -> tuple[str | None, str]:
    text = text_of(msg.get("content"), f"messages[{i}]")
    if msg.get("role") == "tool":
        return str(msg.get("tool_call_id") or ""), f"<tool_result>{text}</tool_result>"
    return None, text


def _ordered_parts(items: list[tuple[str | None, str]], order: dict[str, int]) -> list[str]:
    """Tool results sorted by call order (stable; an unknown id sorts as the first call), other parts in place."""
    results = sorted((p for p in items if p[0] is not None), key=lambda p: order.get(p[0] or "", 0))
    it = iter(results)
    return [next(it)[1] if tid is not None else text for tid, text in items]
