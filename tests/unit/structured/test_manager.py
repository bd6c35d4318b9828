"""Compiled grammars cached by spec key, bounded, errors surfaced typed."""

from __future__ import annotations

import pytest

from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend
from dsv4_serving.structured.manager import GrammarManager
from dsv4_serving.structured.spec import GrammarSpec, GrammarSpecError, spec_from_request

pytestmark = pytest.mark.unit


def _spec(n: int, name: str = "t") -> GrammarSpec:
    schema = {"type": "object", "properties": {f"p{n}": {"type": "integer"}}, "required": [f"p{n}"]}
    spec = spec_from_request(
        {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    )
    assert spec is not None
    return spec


def test_cache_hits_by_key_and_evicts_least_recent(backend: LLGuidanceBackend) -> None:
    mgr = GrammarManager(backend, capacity=2)
    first = mgr.compile(_spec(1))
    assert mgr.compile(_spec(1, name="other")) is first  # same schema, other name: a hit
    mgr.compile(_spec(2))
    mgr.compile(_spec(1))  # 1 is now the most recent
    mgr.compile(_spec(3))  # evicts 2
    assert len(mgr) == 2 and (mgr.hits, mgr.misses) == (2, 3)
    assert mgr.compile(_spec(1)) is first
    mgr.compile(_spec(2))
    assert mgr.misses == 4
    mgr.close()


def test_errors_are_typed_and_not_cached(backend: LLGuidanceBackend) -> None:
    mgr = GrammarManager(backend)
    bad = spec_from_request(
        {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "frob"}}}
    )
    assert bad is not None
    with pytest.raises(GrammarSpecError, match="frob"):
        mgr.check(bad)
    with pytest.raises(GrammarSpecError, match="frob"):
        mgr.compile_async(bad).result(timeout=30)
    assert len(mgr) == 0
    mgr.close()


def test_compile_async_and_matcher(backend: LLGuidanceBackend) -> None:
    mgr = GrammarManager(backend, compile_threads=2)
    grammar = mgr.compile_async(_spec(7)).result(timeout=30)
    assert mgr.compile(_spec(7)) is grammar
    assert mgr.matcher(_spec(7)).validate(list(b'{"p7":1}')) == 8
    mgr.close()


def test_capacity_must_be_positive(backend: LLGuidanceBackend) -> None:
    with pytest.raises(ValueError, match="capacity"):
        GrammarManager(backend, capacity=0)
