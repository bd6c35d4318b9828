"""DSML, DeepSeek's markup for tool calls: its markers and how a parameter is written and read.

A parameter is ``<｜DSML｜parameter name="K" string="true">raw text</｜DSML｜parameter>`` for a
string (no escaping at all) and ``string="false"`` with the value in JSON otherwise.
"""

# DeepSeek's markers are spelled with U+FF5C, not an ASCII bar
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"

INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"

# V4 names the block of calls "tool_calls"; V3.2 named it "function_calls"
V4_BLOCK = "tool_calls"
V32_BLOCK = "function_calls"


def block_open(block: str) -> str:
    return f"<{DSML}{block}>"


def block_close(block: str) -> str:
    return f"</{DSML}{block}>"


def to_json(value: Any) -> str:
    """JSON the way DeepSeek's encoder writes it: ``, ``/``: `` separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def render_parameter(name: str, value: Any) -> str:
    is_str = isinstance(value, str)
    text = value if is_str else to_json(value)
    flag = "true" if is_str else "false"
    return f'{PARAM_OPEN} name="{name}" string="{flag}">{text}{PARAM_CLOSE}'


def render_invoke(name: str, arguments: Mapping[str, Any]) -> str:
    params = "\n".join(render_parameter(k, v) for k, v in arguments.items())
    return f'{INVOKE_OPEN} name="{name}">\n{params}\n{INVOKE_CLOSE}'


def render_block(block: str, invokes: list[str]) -> str:
    """The block of calls, without the ``\\n\\n`` that separates it from the content."""
    return f"{block_open(block)}\n" + "\n".join(invokes) + f"\n{block_close(block)}"


def parameter_json(raw: str, is_string: bool) -> str:
    """One parameter's value as JSON text for the call's ``arguments``.

    A string is JSON-quoted; anything else is the model's JSON, kept verbatim when it parses. A
    ``string="false"`` value that is not JSON (a bare word the model mis-flagged) is quoted as a
    string, so that ``arguments`` is always valid JSON.
    """
    if is_string:
        return to_json(raw)
    try:
        json.loads(raw)
    except ValueError:
        return to_json(raw)
    return raw


def arguments_json(params: list[tuple[str, str, bool]]) -> str:
    """``{"k": v, ...}`` from (name, raw value, is_string), in the order the model wrote them."""
    body = ", ".join(f"{to_json(k)}: {parameter_json(raw, s)}" for k, raw, s in params)
    return "{" + body + "}"
