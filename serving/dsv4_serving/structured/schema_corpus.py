"""A corpus of JSON schemas for structured outputs: nested objects, arrays, enums, bounded
numbers, required fields, ``$defs`` and ``$ref`` (recursion included), ``anyOf``/``oneOf``,
patterns and formats. The unit walks, the engine tests and ``benchmarks/structured.py`` all use
this one set (each entry: ``name``, ``schema``)."""

from __future__ import annotations

import json
from typing import Any

_CORPUS = r"""
[
{"name": "flat", "schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": false}},
{"name": "nested", "schema": {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}, "required": ["id", "address"], "additionalProperties": false}}, "required": ["user"], "additionalProperties": false}},
{"name": "int_array", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5}},
{"name": "string_enum", "schema": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": false}},
{"name": "bounded_numbers", "schema": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "temp": {"type": "number", "minimum": -50, "maximum": -10}}, "required": ["age", "ratio", "temp"], "additionalProperties": false}},
{"name": "defs_ref", "schema": {"type": "object", "$defs": {"address": {"type": "object", "properties": {"street": {"type": "string"}, "number": {"type": "integer", "minimum": 1}}, "required": ["street", "number"], "additionalProperties": false}}, "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}}, "required": ["home"], "additionalProperties": false}},
{"name": "any_of", "schema": {"type": "object", "properties": {"value": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}, "required": ["value"], "additionalProperties": false}},
{"name": "nullable_type_list", "schema": {"type": "object", "properties": {"nickname": {"type": ["string", "null"]}}, "required": ["nickname"], "additionalProperties": false}},
{"name": "pattern", "schema": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}, "required": ["code"], "additionalProperties": false}},
{"name": "array_of_objects", "schema": {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["sku", "qty"], "additionalProperties": false}, "maxItems": 4}}, "required": ["items"], "additionalProperties": false}},
{"name": "const", "schema": {"type": "object", "properties": {"version": {"const": "v1"}, "ok": {"type": "boolean"}}, "required": ["version", "ok"], "additionalProperties": false}},
{"name": "deep", "schema": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "object", "properties": {"d": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, "required": ["d"], "additionalProperties": false}}, "required": ["c"], "additionalProperties": false}}, "required": ["b"], "additionalProperties": false}}, "required": ["a"], "additionalProperties": false}},
{"name": "recursive_tree", "schema": {"$defs": {"node": {"type": "object", "properties": {"label": {"type": "string", "maxLength": 8}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["label", "children"], "additionalProperties": false}}, "$ref": "#/$defs/node"}},
{"name": "openai_strict_style", "schema": {"type": "object", "properties": {"title": {"type": "string"}, "priority": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "null"}]}, "tags": {"type": "array", "items": {"type": "string", "enum": ["bug", "feature", "docs"]}}}, "required": ["title", "priority", "tags"], "additionalProperties": false}},
{"name": "string_lengths", "schema": {"type": "object", "properties": {"short": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["short"], "additionalProperties": false}},
{"name": "mixed_enum", "schema": {"type": "object", "properties": {"x": {"enum": [1, "two", null, true, 3.5]}}, "required": ["x"], "additionalProperties": false}},
{"name": "optional_fields", "schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}, "additionalProperties": false}},
{"name": "multiple_of", "schema": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}}, "required": ["n"], "additionalProperties": false}},
{"name": "one_of_shapes", "schema": {"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}, "required": ["kind", "r"], "additionalProperties": false}, {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 0}}, "required": ["kind", "side"], "additionalProperties": false}]}},
{"name": "map_of_ints", "schema": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3}},
{"name": "tuple", "schema": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}], "items": false, "minItems": 3}},
{"name": "free_object", "schema": {"type": "object"}},
{"name": "nullable_nested_ref", "schema": {"type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": false}}, "properties": {"origin": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]}, "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3}}, "required": ["origin", "path"], "additionalProperties": false}},
{"name": "top_level_number", "schema": {"type": "number", "minimum": -1000, "maximum": 1000}},
{"name": "date_format", "schema": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}, "stamp": {"type": "string", "format": "date-time"}}, "required": ["day"], "additionalProperties": false}}
]
"""


def schemas() -> list[dict[str, Any]]:
    """A fresh copy of the corpus (callers may change it)."""
    out: list[dict[str, Any]] = json.loads(_CORPUS)
    return out
