"""A Lark grammar (llguidance's dialect) for a DSML block of tool calls, as ``dsml.render_block``
writes it: ``tool_choice`` required or a named tool forces one.

Each ``invoke`` names one of the tools; its parameters are the tool's ``properties`` in schema
order, the required ones always, the others optionally. A plain string parameter is written raw
(``string="true"``, no ``<`` inside: the close tag cannot be forged); any other parameter is JSON
under its own schema (``%json``, with the root's ``$defs`` so ``$ref`` resolves), so the call's
arguments validate against the tool's schema.
"""

# DeepSeek's markers are spelled with U+FF5C, not an ASCII bar

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dsv4_serving.chat import dsml

# a string parameter with any of these keywords is written as JSON, where the grammar enforces them
_STRING_CONSTRAINTS = ("enum", "const", "pattern", "format", "minLength", "maxLength")
_DEFS = ("$defs", "definitions")


class ToolGrammarError(ValueError):
    """A tool's parameters schema has no DSML grammar (the API's 400 names ``field``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def tool_calls_lark(
    tools: Sequence[tuple[str, Mapping[str, Any]]],
    parallel: bool,
    block: str = dsml.V4_BLOCK,
    json_options: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Rules (name -> body) of the block; ``calls`` is its start. ``tools``: (name, parameters
    schema) pairs; ``json_options``: llguidance's JSON options for every ``%json`` value."""
    rules: dict[str, str] = {}
    invokes = []
    for i, (name, params) in enumerate(tools):
        rules.update(_invoke_rules(i, name, params, json_options or {}))
        invokes.append(f"invoke_{i}")
    rules["invoke"] = " | ".join(invokes)
    more = ' ("\\n" invoke)*' if parallel else ""
    rules["calls"] = (
        f'"\\n\\n"? {lit(dsml.block_open(block) + chr(10))} invoke{more} '
        f"{lit(chr(10) + dsml.block_close(block))}"
    )
    rules["RAW_STRING"] = "/[^<]*/"
    return rules


def render_lark(rules: Mapping[str, str], start: str) -> str:
    return f"start: {start}\n" + "".join(f"{k}: {v}\n" for k, v in rules.items())


def _invoke_rules(
    i: int, name: str, params: Mapping[str, Any], options: Mapping[str, Any]
) -> dict[str, str]:
    field = f"tools[{i}].function.parameters"
    if not isinstance(params, Mapping):
        raise ToolGrammarError(field, "must be an object schema for a forced tool call")
    props = params.get("properties", {})
    if params.get("type", "object") != "object" or not isinstance(props, Mapping):
        raise ToolGrammarError(field, "must be {'type': 'object', 'properties': {...}}")
    required = params.get("required", [])
    missing = [r for r in required if r not in props]
    if missing:
        raise ToolGrammarError(f"{field}.required", f"names properties not defined: {missing}")
    defs = {k: params[k] for k in _DEFS if k in params}
    rules: dict[str, str] = {}
    items = []
    for j, (key, schema) in enumerate(props.items()):
        rule = f"param_{i}_{j}"
        rules[rule] = _param(key, schema, defs, options)
        items.append(f'{rule} "\\n"' if key in required else f'({rule} "\\n")?')
    head = lit(f'{dsml.INVOKE_OPEN} name="{name}">\n')
    body = " ".join(items) if items else '"\\n"'
    rules[f"invoke_{i}"] = f"{head} {body} {lit(dsml.INVOKE_CLOSE)}"
    return rules


def _param(key: str, schema: Any, defs: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    if _plain_string(schema):
        head = lit(f'{dsml.PARAM_OPEN} name="{key}" string="true">')
        return f"{head} RAW_STRING {lit(dsml.PARAM_CLOSE)}"
    sub: dict[str, Any] = {} if schema is True else dict(schema)
    for k, v in defs.items():
        sub.setdefault(k, v)
    sub["x-guidance"] = dict(options)
    head = lit(f'{dsml.PARAM_OPEN} name="{key}" string="false">')
    return f"{head} %json {json.dumps(sub, ensure_ascii=False)} {lit(dsml.PARAM_CLOSE)}"


def _plain_string(schema: Any) -> bool:
    return (
        isinstance(schema, Mapping)
        and schema.get("type") == "string"
        and not any(k in schema for k in _STRING_CONSTRAINTS)
    )
