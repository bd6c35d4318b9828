"""OpenAPI v3 building blocks for the CRD: terse helpers so the schema reads like the spec."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def obj(
    properties: dict[str, Schema],
    *,
    required: list[str] | None = None,
    rules: list[tuple[str, str]] | None = None,
    default: Any = None,
    description: str | None = None,
) -> Schema:
    """An object; ``rules`` are (CEL expression, message) pairs checked by the API server.

    ``default={}`` is expanded to the defaults of the properties, recursively: the API server
    checks a default against the CEL rules as written, without defaulting inside it first.
    """
    s: Schema = {"type": "object", "properties": properties}
    if required:
        s["required"] = required
    if rules:
        s["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in rules]
    if default is not None:
        s["default"] = default or defaults_of(s)
    if description:
        s["description"] = description
    return s


def defaults_of(schema: Schema) -> dict[str, Any]:
    """The value an empty object takes after structural defaulting."""
    out: dict[str, Any] = {}
    for name, prop in schema.get("properties", {}).items():
        if "default" in prop:
            out[name] = prop["default"]
    return out


def string(
    description: str,
    *,
    default: str | None = None,
    enum: list[str] | None = None,
    pattern: str | None = None,
    min_length: int | None = None,
    max_length: int | None = None,
) -> Schema:
    s: Schema = {"type": "string", "description": description}
    if default is not None:
        s["default"] = default
    if enum:
        s["enum"] = enum
    if pattern:
        s["pattern"] = pattern
    if min_length is not None:
        s["minLength"] = min_length
    if max_length is not None:
        s["maxLength"] = max_length
    return s


def integer(
    description: str,
    *,
    default: int | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
) -> Schema:
    s: Schema = {"type": "integer", "format": "int32", "description": description}
    if default is not None:
        s["default"] = default
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return s


def number(
    description: str, *, default: float | None = None, minimum: float | None = None
) -> Schema:
    s: Schema = {"type": "number", "description": description}
    if default is not None:
        s["default"] = default
    if minimum is not None:
        s["minimum"] = minimum
    return s


def boolean(description: str, *, default: bool | None = None) -> Schema:
    s: Schema = {"type": "boolean", "description": description}
    if default is not None:
        s["default"] = default
    return s


def string_list(description: str, *, max_items: int = 256) -> Schema:
    return {
        "type": "array",
        "description": description,
        "items": {"type": "string", "maxLength": 4096},
        "maxItems": max_items,
    }


def string_map(description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {"type": "string"},
    }


def opaque(description: str, *, array: bool = False) -> Schema:
    """A core Kubernetes type (affinity, tolerations, ...) validated by the API server when the
    operator copies it into the pod template, not duplicated here."""
    if array:
        return {
            "type": "array",
            "description": description,
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        }
    return {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }


QUANTITY: Schema = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
}


def resources(description: str) -> Schema:
    """corev1.ResourceRequirements (requests and limits only); each amount a quantity, checked
    with CEL so the message says so (a regular expression's message only shows itself)."""
    qmap = {
        "type": "object",
        "additionalProperties": QUANTITY,
        "maxProperties": 8,
        "x-kubernetes-validations": [
            {
                "rule": "self.all(k, type(self[k]) == int || isQuantity(string(self[k])))",
                "message": "each resource amount must be a Kubernetes quantity such as 500m, "
                "2, 512Mi or 4Gi",
            }
        ],
    }
    return obj({"requests": qmap, "limits": qmap}, description=description)
