"""Per-request matchers of a sampling rank: draft rows, verified advances, drops."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from dsv4_serving.structured.backend import CompiledGrammar, bitmask_words
from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend
from dsv4_serving.structured.request_grammars import RequestGrammars
from dsv4_serving.structured.spec import GrammarSpecError, spec_from_request

pytestmark = pytest.mark.unit

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


def allowed(row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return {int(t) for t in np.flatnonzero(bits)}


def done(value: Any) -> Future[CompiledGrammar]:
    fut: Future[CompiledGrammar] = Future()
    fut.set_result(value)
    return fut


@pytest.fixture
def grammars(backend: LLGuidanceBackend, eos_id: int) -> RequestGrammars:
    spec = spec_from_request(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    )
    assert spec is not None
    g = RequestGrammars(backend.vocab_size, [eos_id])
    g.add("r", done(backend.compile(spec)))
    return g


def ids(text: str) -> list[int]:
    return list(text.encode())  # the tiny tokenizer: byte b is token b


def test_rows_follow_the_drafts_and_leave_the_state(grammars: RequestGrammars) -> None:
    vocab = grammars.vocab_size
    rows, kept = grammars.rows("r", ids('{"a'))
    assert kept == 3 and rows.shape == (4, bitmask_words(vocab))
    assert allowed(rows[0], vocab) == {ord("{")}  # no whitespace before the value
    assert ord('"') in allowed(rows[1], vocab) and ord("a") in allowed(rows[2], vocab)
    assert allowed(rows[3], vocab) == {ord('"')}  # "a" is the only key
    again, _ = grammars.rows("r", [])  # the state did not move
    assert np.array_equal(again[0], rows[0])


def test_a_refused_draft_cuts_the_rest(grammars: RequestGrammars) -> None:
    rows, kept = grammars.rows("r", ids('{x"'))
    assert kept == 1 and rows.shape[0] == 2


def test_advance_then_only_eos(grammars: RequestGrammars, eos_id: int) -> None:
    grammars.advance("r", ids('{"a":7}'))
    rows, kept = grammars.rows("r", [eos_id, eos_id])
    assert kept == 0 and allowed(rows[0], grammars.vocab_size) == {eos_id}
    grammars.advance("r", [eos_id, eos_id])  # EOS again (min_tokens / ignore_eos) is fine
    with pytest.raises(AssertionError, match="outside its mask"):
        grammars.advance("r", ids("x"))


def test_drop_forgets(grammars: RequestGrammars) -> None:
    grammars.rows("r", [])
    assert "r" in grammars and len(grammars) == 1
    grammars.drop("r")
    grammars.drop("r")  # twice: finished, then aborted
    assert "r" not in grammars and len(grammars) == 0


def test_a_failed_compile_allows_eos_only(backend: LLGuidanceBackend, eos_id: int) -> None:
    g = RequestGrammars(backend.vocab_size, [eos_id])
    fut: Future[CompiledGrammar] = Future()
    fut.set_exception(GrammarSpecError("response_format", "bad"))
    g.add("r", fut)
    rows, kept = g.rows("r", ids("{"))
    assert kept == 0 and allowed(rows[0], backend.vocab_size) == {eos_id}
