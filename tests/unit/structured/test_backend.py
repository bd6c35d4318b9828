"""The llguidance backend: schema errors, masks, drafts, rollback, termination."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dsv4_serving.structured.backend import bitmask_words
from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend
from dsv4_serving.structured.spec import GrammarSpec, GrammarSpecError, spec_from_request

pytestmark = pytest.mark.unit

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _spec(schema: Any, strict: bool = True) -> GrammarSpec:
    spec = spec_from_request(
        {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}}
    )
    assert spec is not None
    return spec


def _ids(text: str) -> list[int]:
    return list(text.encode())  # the tiny tokenizer: one token per byte


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "frob"}, "frob"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "format": "frobnicate"}, "frobnicate"),
    ],
)
def test_invalid_schema_names_problem_and_field(
    backend: LLGuidanceBackend, schema: Any, words: str
) -> None:
    spec = _spec(schema)
    for call in (backend.check, backend.compile):
        with pytest.raises(GrammarSpecError) as info:
            call(spec)
        assert info.value.field == "response_format.json_schema.schema"
        assert words in info.value.problem and "\n" not in str(info.value)


def test_non_strict_drops_what_it_cannot_enforce(backend: LLGuidanceBackend) -> None:
    spec = _spec({"type": "string", "format": "frobnicate"}, strict=False)
    backend.check(spec)
    assert any("frobnicate" in w for w in backend.compile(spec).warnings)


def test_a_tool_without_an_object_schema_is_refused(backend: LLGuidanceBackend) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    spec = spec_from_request(None, [tool], "required")
    assert spec is not None
    with pytest.raises(GrammarSpecError, match="type") as info:
        backend.check(spec)
    assert info.value.field == "tools[0].function.parameters"


def test_mask_allows_exactly_the_grammar(backend: LLGuidanceBackend) -> None:
    m = backend.compile(_spec(SCHEMA)).matcher()
    row = np.zeros(bitmask_words(backend.vocab_size), dtype=np.int32)
    m.fill_bitmask(row)
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    assert (
        set(allowed) <= {ord("{"), ord(" "), ord("\t"), ord("\n"), ord("\r")}
        and ord("{") in allowed
    )
    with pytest.raises(ValueError, match="row"):
        m.fill_bitmask(np.zeros((1, row.size), dtype=np.int32))


def test_padding_ids_never_allowed(tokenizer: Any, eos_id: int) -> None:
    wide = LLGuidanceBackend(tokenizer, [eos_id], 300)  # logits wider than the tokenizer
    m = wide.compile(_spec({"type": "string"})).matcher()
    assert m.accept(ord('"'))
    row = np.zeros(bitmask_words(300), dtype=np.int32)
    m.fill_bitmask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert bits[ord("a")] and not bits[tokenizer.get_vocab_size() :].any()


def test_draft_validation_reports_accepted_prefix(backend: LLGuidanceBackend) -> None:
    m = backend.compile(_spec(SCHEMA)).matcher()
    for t in _ids('{"a":1'):
        assert m.accept(t)
    drafts = _ids('2,"b":tXue}')  # 'X' is the bad token, at index 7
    assert m.validate(drafts) == 7
    assert m.validate(_ids('2,"b":true}')) == 11  # validate never advances the state
    assert m.accept(ord("2")) and not m.is_terminated()


def test_accept_refuses_and_rollback_recovers(backend: LLGuidanceBackend, eos_id: int) -> None:
    m = backend.compile(_spec(SCHEMA)).matcher()
    for t in _ids('{"a":12,"b":'):
        assert m.accept(t)
    for t in _ids("fal"):
        assert m.accept(t)
    m.rollback(3)
    for t in _ids("true}"):
        assert m.accept(t)
    assert m.is_terminated()
    fresh = backend.compile(_spec(SCHEMA)).matcher()
    assert not fresh.accept(ord("x")) and "x" in fresh.error() and not fresh.is_terminated()


def test_top_level_value_ends_with_eos(backend: LLGuidanceBackend, eos_id: int) -> None:
    m = backend.compile(_spec({"type": "integer"})).matcher()
    assert m.accept(ord("4")) and not m.is_terminated()
    assert m.accept(eos_id) and m.is_terminated()


def test_matchers_are_independent(backend: LLGuidanceBackend) -> None:
    grammar = backend.compile(_spec(SCHEMA))
    one, two = grammar.matcher(), grammar.matcher()
    assert one.accept(ord("{"))
    assert two.validate(_ids('{"a"')) == 4 and one.validate(_ids('{"a"')) == 0
