"""One declaration per CRD field, read two ways: as the OpenAPI schema and as the typed spec.

Each object of the CRD's spec is a frozen dataclass; each of its properties a field declared with
``prop`` (a leaf: its OpenAPI schema, which holds the description, the default and the
validation) or ``section`` (a nested object: another such dataclass). ``object_schema`` walks
the fields to build the schema (properties in field order), ``from_crd`` to build the dataclass
from the object the API server stored (each value converted as its schema's type says). A
field's dataclass default is its schema's default, or its empty value (None, [], {}) when it has
none, so an absent field reads the same both ways.

Some sections are declared once for several places: a role's section for prefill and for
decode. Their schemas are then functions of that place's name (``ctx``), given by the field
that holds the section.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING
from typing import TYPE_CHECKING, Any, TypeVar

from dsv4_operator.api.schema import QUANTITY, Schema, obj

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
Rules = Sequence[tuple[str, str]]
OfCtx = Callable[[str], Any]
"""A part of a declaration that depends on the section's place (``ctx``, e.g. the role)."""

_KEY = "crd"


@dataclasses.dataclass(frozen=True)
class _Prop:
    schema: Schema | Callable[[str], Schema]
    key: str | None
    required: bool
    parse: Callable[[Any], Any] | None


@dataclasses.dataclass(frozen=True)
class _Section:
    cls: type[Any]
    key: str | None
    ctx: str | None
    required: bool


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """The field takes the section's place name (a role's section knows its role)."""


@dataclasses.dataclass(frozen=True)
class _Object:
    rules: Rules | Callable[[str], Rules]
    description: str | Callable[[str], str] | None
    defaulted: bool


_OBJECTS: dict[type[Any], _Object] = {}


def crd_object(
    *,
    rules: Rules | Callable[[str], Rules] = (),
    description: str | Callable[[str], str] | None = None,
    defaulted: bool = False,
) -> Callable[[type[T]], type[T]]:
    """Declare a dataclass an object of the CRD. ``rules``: (CEL, message) pairs the API server
    checks on it; ``defaulted``: an absent object is an empty one, its fields' defaults."""

    def register(cls: type[T]) -> type[T]:
        _OBJECTS[cls] = _Object(rules, description, defaulted)
        return cls

    return register


def _empty(schema: Schema) -> Any:
    """The value of a leaf the object does not set (after defaulting)."""
    if "default" in schema:
        return schema["default"]
    return {"array": [], "object": {}}.get(schema.get("type", ""))


def prop(
    schema: Schema | Callable[[str], Schema],
    *,
    key: str | None = None,
    required: bool = False,
    parse: Callable[[Any], Any] | None = None,
    absent: Any = MISSING,
) -> Any:
    """A leaf property. ``key``: its name in the CRD (default: the attribute's, camelCase);
    ``parse``: turns the stored value into the attribute's (default: by the schema's type);
    ``absent``: the attribute when the object does not set it (default: the schema's default,
    else an empty value)."""
    meta = {_KEY: _Prop(schema, key, required, parse)}
    if required:
        return dataclasses.field(metadata=meta)
    if absent is MISSING:
        absent = _empty(schema if isinstance(schema, dict) else schema(""))
    if isinstance(absent, list | dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(absent), metadata=meta)
    return dataclasses.field(default=absent, metadata=meta)


def section(
    cls: type[Any], *, key: str | None = None, ctx: str | None = None, required: bool = False
) -> Any:
    """A nested object, declared by the dataclass ``cls``; ``ctx``: the place name its
    declaration is made for. Absent: its defaults if it is ``defaulted``, else None."""
    meta = {_KEY: _Section(cls, key, ctx, required)}
    if required:
        return dataclasses.field(metadata=meta)
    if _OBJECTS[cls].defaulted:
        return dataclasses.field(
            default_factory=lambda: from_crd(cls, {}, ctx or ""), metadata=meta
        )
    return dataclasses.field(default=None, metadata=meta)


def place() -> Any:
    """A field that holds the section's place name (``ctx``) rather than a property."""
    return dataclasses.field(metadata={_KEY: _Ctx()})


def _camel(name: str) -> str:
    return re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name)


def _declared(cls: type[Any]) -> list[tuple[dataclasses.Field[Any], _Prop | _Section, str]]:
    out = []
    for f in dataclasses.fields(cls):
        d = f.metadata.get(_KEY)
        if isinstance(d, _Prop | _Section):
            out.append((f, d, d.key or _camel(f.name)))
    return out


def _of(value: Any, ctx: str) -> Any:
    return value(ctx) if callable(value) else value


def object_schema(cls: type[Any], ctx: str = "") -> Schema:
    """The OpenAPI schema of the object ``cls`` declares (for the place ``ctx``)."""
    o = _OBJECTS[cls]
    props: dict[str, Schema] = {}
    for _, d, key in _declared(cls):
        if isinstance(d, _Section):
            props[key] = object_schema(d.cls, d.ctx if d.ctx is not None else ctx)
        else:
            # a copy per place: a leaf two places share would be dumped as a YAML anchor (the
            # building blocks' own shared QUANTITY stays shared, as they build it)
            props[key] = copy.deepcopy(_of(d.schema, ctx), {id(QUANTITY): QUANTITY})
    return obj(
        props,
        required=[key for _, d, key in _declared(cls) if d.required],
        rules=list(_of(o.rules, ctx)),
        default={} if o.defaulted else None,
        description=_of(o.description, ctx),
    )


_BY_TYPE: dict[str, Callable[[Any], Any]] = {
    "integer": int,
    "number": float,
    "boolean": bool,
    "string": str,
}


def from_crd(cls: type[T], raw: dict[str, Any], ctx: str = "", **given: Any) -> T:
    """The dataclass ``cls`` from its object as stored (defaults applied); ``given``: its fields
    that are no property (metadata, for the root)."""
    values: dict[str, Any] = dict(given)
    for f in dataclasses.fields(cls):
        if isinstance(f.metadata.get(_KEY), _Ctx):
            values[f.name] = ctx
    for f, d, key in _declared(cls):
        value = raw.get(key)
        if value is None and d.required:
            raise KeyError(key)  # as reading it would (the API server refuses such objects)
        if isinstance(d, _Section):
            if value is not None or _OBJECTS[d.cls].defaulted:
                values[f.name] = from_crd(d.cls, value or {}, d.ctx if d.ctx is not None else ctx)
        elif value is not None:  # else the dataclass default: the same as an absent property
            kind = _of(d.schema, ctx).get("type", "")
            values[f.name] = (d.parse or _BY_TYPE.get(kind, copy.deepcopy))(value)
    return cls(**values)


def not_yet(field: str, why: str, fix: str) -> str:
    """The message of a rule that keeps a field at its default until something acts on it."""
    return f"{field} is not supported yet ({why}); {fix}"
