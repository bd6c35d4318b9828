"""DeepSeek V3.2's chat format, where it differs from V4's (``encoding_v4.py``).

V3.2 names the block of calls ``function_calls``, has its own tools text, appends tool results
to the assistant's turn as ``<function_results>`` (no user turn), wraps a developer message as
``# The user's message is:``, always drops earlier reasoning in thinking mode (tools or not), and
has no effort prompts. Checked byte for byte against DeepSeek's published V3.2 golden.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsv4_serving.chat import dsml
from dsv4_serving.chat.encoding_v4 import RESPONSE_FORMAT
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

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{dsml}function_calls>
...
</{dsml}function_calls>

<function_results>
...
</function_results>

{think_open}...thinking about results{think_close}

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(dsml.to_json(fn) for fn in tool_functions(tools))
    return TOOLS_TEMPLATE.format(
        dsml=dsml.DSML, think_open=dsml.THINK_OPEN, think_close=dsml.THINK_CLOSE, schemas=schemas
    )


def _extras(msg: Message) -> str:
    out = "\n\n" + render_tools(msg["tools"]) if msg.get("tools") else ""
    if msg.get("response_format") is not None:
        out += "\n\n" + RESPONSE_FORMAT.format(schema=dsml.to_json(msg["response_format"]))
    return out


def encode(messages: Sequence[Message], opts: EncodeOptions) -> str:
    """The whole prompt; ``opts.effort`` has no V3.2 prompt and is not rendered."""
    msgs = with_system_extras(messages, opts)
    if opts.thinking and opts.drop_thinking:
        msgs = drop_earlier_reasoning(msgs)
    last = last_user_index(msgs)
    prompt = dsml.BOS
    for i in range(len(msgs)):
        prompt += _render(msgs, i, opts.thinking, last)
    return prompt


def _render(msgs: Sequence[Message], i: int, thinking: bool, last: int) -> str:
    msg, where = msgs[i], f"messages[{i}]"
    role = msg.get("role")
    think = dsml.THINK_OPEN if thinking and i == last else dsml.THINK_CLOSE
    if role == "system":
        return text_of(msg.get("content"), where) + _extras(msg)
    if role == "user":
        return dsml.USER + text_of(msg.get("content"), where) + dsml.ASSISTANT + think
    if role == "developer":
        content = text_of(msg.get("content"), where)
        if not content:
            raise ChatFormatError(f"{where}: a developer message needs content")
        body = _extras(msg) + f"\n\n# The user's message is: {content}"
        return dsml.USER + body + dsml.ASSISTANT + think
    if role == "tool":
        return _tool_result(msgs, i, thinking, last)
    if role == "assistant":
        return _assistant(msg, where, thinking and i > last)
    raise ChatFormatError(f"{where}: role {role!r} is not supported")


def _assistant(msg: Message, where: str, with_reasoning: bool) -> str:
    head = reasoning_of(msg) + dsml.THINK_CLOSE if with_reasoning else ""
    calls = tool_calls_of(msg, where)
    block = ""
    if calls:
        invokes = [dsml.render_invoke(c.name, c.arguments) for c in calls]
        block = "\n\n" + dsml.render_block(dsml.V32_BLOCK, invokes)
    return head + text_of(msg.get("content"), where) + block + dsml.EOS


def _tool_result(msgs: Sequence[Message], i: int, thinking: bool, last: int) -> str:
    """One ``<result>`` in the ``<function_results>`` that follows the assistant's calls, in the
    order the results come (V3.2 matches them to calls by position)."""
    start = i
    while start > 0 and msgs[start - 1].get("role") == "tool":
        start -= 1
    owner = msgs[start - 1] if start > 0 else None
    n_calls = len(tool_calls_of(owner, "assistant")) if owner is not None else 0
    k = i - start + 1
    if owner is None or owner.get("role") != "assistant" or k > n_calls:
        raise ChatFormatError(f"messages[{i}]: a tool result with no matching assistant tool call")
    out = "\n\n<function_results>" if k == 1 else ""
    out += f"\n<result>{text_of(msgs[i].get('content'), f'messages[{i}]')}</result>"
    if k == n_calls:
        think = dsml.THINK_OPEN if thinking and i >= last else dsml.THINK_CLOSE
        out += "\n</function_results>\n\n" + think
    return out
