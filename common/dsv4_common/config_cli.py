"""Command lines built from config dataclasses, so each setting is declared once: its name, type,
default and help (the docstring under the field) live in the dataclass; the flags, their
``choices`` and their help text are derived from it. Validation stays in ``__post_init__``.

    add_config_arguments(parser, EngineConfig)          # --max-num-seqs, --role {both,...}
    cfg = config_from_args(EngineConfig, args, base=values_from_a_file)

A flag that is not given leaves no attribute on the namespace (``argparse.SUPPRESS``), so
``config_from_args`` can tell "not given" from "given the default" and a file's values survive.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any, Literal, TypeVar

T = TypeVar("T")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (and its bases), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X`` (None is reachable only through a file or the dataclass default)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def add_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    exclude: Iterable[str] = (),
    aliases: Mapping[str, Iterable[str]] | None = None,
    metavars: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of ``cls`` (``snake_case`` -> ``--kebab-case``): ``Literal`` fields get
    ``choices``, ``bool`` fields ``--x/--no-x``, ``X | None`` fields type ``X``, ``list[X]`` fields
    a repeatable flag. ``aliases`` adds other spellings of a field's flag (kept for
    compatibility); ``exclude`` leaves fields out (set by the caller some other way, e.g. a
    secret read from a file)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    skip = set(exclude)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "")
        if default is not None and not isinstance(default, bool):
            help_text = f"{help_text} (default: {default})".strip()
        names = [flag_name(f.name), *((aliases or {}).get(f.name, ()))]
        kw: dict[str, Any] = {
            "dest": f.name,
            "default": argparse.SUPPRESS,
            "help": help_text.replace("%", "%%"),
        }
        if metavars and f.name in metavars:
            kw["metavar"] = metavars[f.name]
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
            kw["help"] = f"{kw['help']} (default: {'on' if default else 'off'})".strip()
        elif typing.get_origin(tp) is Literal:
            choices = typing.get_args(tp)
            kw["choices"] = list(choices)
            kw["type"] = type(choices[0])
        elif tp in (int, float, str):
            # a field may name its own parser for the flag's text (e.g. sizes written "64M")
            kw["type"] = f.metadata.get("parse", tp)
        elif typing.get_origin(tp) is list and typing.get_args(tp)[0] in (int, float, str):
            # repeated: --prefill URL --prefill URL (given at all, the flags replace the default)
            kw["action"] = "append"
            kw["type"] = typing.get_args(tp)[0]
            kw["help"] = f"{kw['help']} (repeatable)".strip()
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for type {tp!r}")
        parser.add_argument(*names, **kw)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` that were set on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def config_from_args(
    cls: type[T], args: argparse.Namespace, base: Mapping[str, Any] | None = None, **fixed: Any
) -> T:
    """``cls(**base, **flags given, **fixed)``: flags override the base (a config file), ``fixed``
    (values the caller computed) overrides both."""
    return cls(**{**(base or {}), **given(cls, args), **fixed})
