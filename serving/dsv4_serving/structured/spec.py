"""What a request asks the output to match: a typed ``GrammarSpec`` and its cache key."""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# OpenAI's rule for json_schema.name and function names
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class GrammarSpecError(ValueError):
    """A request's grammar is invalid or unsupported; ``field`` names the request field (a 400)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class GrammarKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # a JSON value matching ``schema``
    TOOL_CALLS = "tool_calls"  # tool_choice required / named: a DSML call block
    REGEX = "regex"  # vLLM's structured_outputs.regex: text matching ``grammar``
    CHOICE = "choice"  # vLLM's structured_outputs.choice: one of ``grammar`` (a JSON list)
    LARK = "lark"  # vLLM's structured_outputs.grammar: llguidance's Lark in ``grammar``


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: str  # the parameters' JSON schema, canonical JSON


@dataclass(frozen=True)
class GrammarSpec:
    """One request's grammar. Schemas are held as canonical JSON, so equal specs are equal."""

    kind: GrammarKind
    field: str  # the request field it came from, for errors
    schema: str = ""  # canonical JSON (JSON_OBJECT, JSON_SCHEMA)
    name: str = ""  # json_schema.name
    strict: bool = False
    tools: tuple[ToolSpec, ...] = ()  # TOOL_CALLS: the tools a call may name
    parallel: bool = True  # TOOL_CALLS: more than one call allowed
    grammar: str = ""  # REGEX, LARK: the source; CHOICE: the choices, canonical JSON
    block: str = "tool_calls"  # TOOL_CALLS: the DSML block's name (the chat format's)
    reasoning: bool = False  # the prompt opened a think block: free reasoning, </think>, then this

    @property
    def key(self) -> str:
        """Cache key: a hash of what the grammar depends on (``name`` and ``field`` do not count)."""
        body = {
            "kind": self.kind.value,
            "schema": self.schema,
            "strict": self.strict,
            "tools": [[t.name, t.parameters] for t in self.tools],
            "parallel": self.parallel,
            "grammar": self.grammar,
            "block": self.block,
            "reasoning": self.reasoning,
        }
        return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, non-ASCII kept: one text per value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def spec_from_request(
    response_format: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    structured_outputs: Mapping[str, Any] | None = None,
) -> GrammarSpec | None:
    """The grammar a request needs, or None (free text). Raises ``GrammarSpecError``."""
    forced = tool_choice is not None and _forces_tools(tool_choice)
    asked = [
        name
        for name, on in (
            ("tool_choice", forced),
            ("response_format", bool(response_format and response_format.get("type") != "text")),
            ("structured_outputs", structured_outputs is not None),
        )
        if on
    ]
    if len(asked) > 1:
        raise GrammarSpecError(asked[1], f"cannot be combined with {asked[0]}")
    if forced:
        assert tool_choice is not None
        return _tool_spec(tools or (), tool_choice, parallel_tool_calls is not False)
    if structured_outputs is not None:
        return _structured_outputs_spec(structured_outputs)
    if response_format is None:
        return None
    return _response_format_spec(response_format)


_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs_spec(so: Mapping[str, Any]) -> GrammarSpec:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(so, Mapping):
        raise GrammarSpecError("structured_outputs", "must be an object")
    unknown = sorted(k for k in so if k not in _SO_KINDS and so[k] not in (None, False))
    if unknown:
        raise GrammarSpecError(f"structured_outputs.{unknown[0]}", "is not supported")
    given = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise GrammarSpecError("structured_outputs", f"needs exactly one of {', '.join(_SO_KINDS)}")
    kind, value = given[0], so[given[0]]
    field = f"structured_outputs.{kind}"
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, field, canonical_json({"type": "object"}))
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise GrammarSpecError(field, f"not JSON: {exc}") from exc
        _check_schema(field, value)
        return GrammarSpec(GrammarKind.JSON_SCHEMA, field, canonical_json(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarSpecError(field, "must be a non-empty list of strings")
        return GrammarSpec(GrammarKind.CHOICE, field, grammar=canonical_json(value))
    if not isinstance(value, str) or not value:
        raise GrammarSpecError(field, "must be a non-empty string")
    return GrammarSpec(
        GrammarKind.REGEX if kind == "regex" else GrammarKind.LARK, field, grammar=value
    )


def _response_format_spec(rf: Mapping[str, Any]) -> GrammarSpec | None:
    if not isinstance(rf, Mapping):
        raise GrammarSpecError("response_format", "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(
            GrammarKind.JSON_OBJECT, "response_format", canonical_json({"type": "object"})
        )
    if kind != "json_schema":
        raise GrammarSpecError(
            "response_format.type", f"must be 'text', 'json_object' or 'json_schema', not {kind!r}"
        )
    js = rf.get("json_schema")
    if not isinstance(js, Mapping):
        raise GrammarSpecError("response_format.json_schema", "must be an object")
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise GrammarSpecError(
            "response_format.json_schema.name", "must be 1-64 letters, digits, '_' or '-'"
        )
    strict = js.get("strict", False)
    if not isinstance(strict, bool):
        raise GrammarSpecError("response_format.json_schema.strict", "must be a boolean")
    field = "response_format.json_schema.schema"
    schema = js.get("schema", {})
    _check_schema(field, schema)
    return GrammarSpec(GrammarKind.JSON_SCHEMA, field, canonical_json(schema), name, strict)


def _forces_tools(tool_choice: str | Mapping[str, Any]) -> bool:
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise GrammarSpecError(
                "tool_choice",
                f"must be 'auto', 'none', 'required' or a function, not {tool_choice!r}",
            )
        return tool_choice == "required"
    return True


def _tool_spec(
    tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any], parallel: bool
) -> GrammarSpec:
    specs = tuple(_one_tool(i, t) for i, t in enumerate(tools))
    if not specs:
        raise GrammarSpecError("tool_choice", "requires tools")
    if isinstance(choice, Mapping):
        wanted = _named_choice(choice)
        specs = tuple(t for t in specs if t.name == wanted)
        if not specs:
            raise GrammarSpecError("tool_choice", f"names {wanted!r}, which is not in tools")
    return GrammarSpec(GrammarKind.TOOL_CALLS, "tool_choice", tools=specs, parallel=parallel)


def _named_choice(choice: Mapping[str, Any]) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise GrammarSpecError(
            "tool_choice", "must be {'type': 'function', 'function': {'name': ...}}"
        )
    return name


def _one_tool(i: int, tool: Mapping[str, Any]) -> ToolSpec:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or tool.get("type") != "function":
        raise GrammarSpecError(f"tools[{i}]", "must be {'type': 'function', 'function': {...}}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise GrammarSpecError(
            f"tools[{i}].function.name", "must be 1-64 letters, digits, '_' or '-'"
        )
    params = fn.get("parameters", {"type": "object", "properties": {}})
    _check_schema(f"tools[{i}].function.parameters", params)
    return ToolSpec(name, canonical_json(params))


def _check_schema(field: str, schema: Any) -> None:
    """The shape checks that need no grammar library; the backend checks the rest."""
    if isinstance(schema, bool):
        return  # true / false are schemas
    if not isinstance(schema, Mapping):
        raise GrammarSpecError(
            field, f"a JSON schema must be an object, not {type(schema).__name__}"
        )
    try:
        canonical_json(schema)
    except (TypeError, ValueError) as exc:
        raise GrammarSpecError(field, f"not JSON: {exc}") from exc
