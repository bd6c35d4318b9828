"""Request pieces -> GrammarSpec; bad ones -> GrammarSpecError naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_serving.structured.spec import GrammarKind, GrammarSpecError, spec_from_request

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def _js(schema: Any, name: str = "answer", **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, **extra}}


def test_no_grammar() -> None:
    assert spec_from_request() is None
    assert spec_from_request({"type": "text"}) is None
    assert spec_from_request(None, [TOOL], "auto") is None
    assert spec_from_request(None, [TOOL], "none") is None


def test_json_object_and_schema() -> None:
    obj = spec_from_request({"type": "json_object"})
    assert (
        obj is not None
        and obj.kind is GrammarKind.JSON_OBJECT
        and obj.schema == '{"type":"object"}'
    )
    spec = spec_from_request(_js(SCHEMA, strict=True))
    assert spec is not None and spec.kind is GrammarKind.JSON_SCHEMA
    assert (
        spec.strict and spec.name == "answer" and spec.field == "response_format.json_schema.schema"
    )


def test_key_is_canonical() -> None:
    a = spec_from_request(
        _js({"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}})
    )
    b = spec_from_request(_js(SCHEMA, name="other"))
    c = spec_from_request(_js(SCHEMA, strict=True))
    assert a is not None and b is not None and c is not None
    assert a.key == b.key  # key order and the name do not matter
    assert a.key != c.key  # strictness does


def test_tool_specs() -> None:
    other = {"type": "function", "function": {"name": "search"}}
    required = spec_from_request(None, [TOOL, other], "required", parallel_tool_calls=False)
    assert required is not None and required.kind is GrammarKind.TOOL_CALLS
    assert [t.name for t in required.tools] == ["get_weather", "search"] and not required.parallel
    named = spec_from_request(
        None, [TOOL, other], {"type": "function", "function": {"name": "search"}}
    )
    assert named is not None and [t.name for t in named.tools] == ["search"] and named.parallel
    assert named.key != required.key


@pytest.mark.parametrize(
    ("args", "field", "words"),
    [
        (({"type": "xml"},), "response_format.type", "'xml'"),
        (({"type": "json_schema"},), "response_format.json_schema", "object"),
        ((_js(SCHEMA, name="bad name"),), "response_format.json_schema.name", "letters"),
        ((_js(SCHEMA, strict="yes"),), "response_format.json_schema.strict", "boolean"),
        ((_js(["not", "a", "schema"]),), "response_format.json_schema.schema", "list"),
        ((None, [], "required"), "tool_choice", "requires tools"),
        ((None, [TOOL], "sometimes"), "tool_choice", "'sometimes'"),
        (
            (None, [TOOL], {"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "'nope'",
        ),
        ((None, [TOOL], {"function": "x"}), "tool_choice", "type"),
        ((None, [{"type": "web"}], "required"), "tools[0]", "function"),
        (
            (None, [{"type": "function", "function": {"name": "a b"}}], "required"),
            "tools[0].function.name",
            "letters",
        ),
        (
            (None, [{"type": "function", "function": {"name": "f", "parameters": 3}}], "required"),
            "tools[0].function.parameters",
            "int",
        ),
        (({"type": "json_object"}, [TOOL], "required"), "response_format", "tool_choice"),
    ],
)
def test_invalid(args: tuple[Any, ...], field: str, words: str) -> None:
    with pytest.raises(GrammarSpecError) as info:
        spec_from_request(*args)
    assert info.value.field == field
    assert words in str(info.value) and str(info.value).startswith(field + ": ")
