"""The engine's half of stream continuation (``entrypoints/continuation.py``): the internal
field checked, the budget left, the text the client has, the state blocks written."""

from __future__ import annotations

import json

import pytest

from dsv4_serving.engine.engine.tokenizer import load_tokenizer
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.sample.seeding import position_seed
from dsv4_serving.entrypoints.checks import BadRequest
from dsv4_serving.entrypoints.continuation import (
    Continuation,
    StateWriter,
    apply,
    parse,
    remaining,
    resume_args,
    sent_text,
)

VOCAB = 512


def test_parse_takes_the_gateway_s_field_and_names_it_when_wrong() -> None:
    assert parse(None, VOCAB) is None
    assert parse({}, VOCAB) == Continuation()
    got = parse({"token_ids": [1, 2], "chars": 3, "id": "c-1", "created": 5}, VOCAB)
    assert got == Continuation((1, 2), 3, "c-1", 5) and got.resumes
    for bad in (
        {"token_ids": [VOCAB]},
        {"token_ids": "12"},
        {"token_ids": [True]},
        {"chars": -1},
        {"id": 3},
        {"extra": 1},
    ):
        with pytest.raises(BadRequest) as e:
            parse(bad, VOCAB)
        assert e.value.param == "continuation"


def test_the_budget_left() -> None:
    p = SamplingParams(max_tokens=10, min_tokens=4)
    got = remaining(p, Continuation((1, 2, 3)))
    assert (got.max_tokens, got.min_tokens) == (7, 1)
    got = remaining(p, Continuation((1,) * 6))
    assert (got.max_tokens, got.min_tokens) == (4, 0)
    with pytest.raises(BadRequest, match="10 tokens already generated"):
        remaining(p, Continuation((1,) * 10))
    penalized = SamplingParams(max_tokens=10, presence_penalty=0.5, frequency_penalty=-1.0)
    got = remaining(penalized, Continuation((1, 2)))
    assert (got.presence_penalty, got.frequency_penalty, got.resumed_tokens) == (0.5, -1.0, 2)


def test_apply_per_leg() -> None:
    p = SamplingParams(max_tokens=10)
    raw = {"token_ids": [7, 8]}
    assert apply(None, VOCAB, True, 1, False, [1], p) == ([1], p, None)
    # a prefill for a remote decode computes prompt + tokens, and that is all
    assert apply(raw, VOCAB, False, 1, True, [1], p) == ([1, 7, 8], p, None)
    ids, params, cont = apply(raw, VOCAB, True, 1, False, [1], p)
    assert (ids, params.max_tokens, cont) == ([1], 8, Continuation((7, 8)))
    assert apply({}, VOCAB, False, 1, False, [1], p) == ([1], p, Continuation())
    with pytest.raises(BadRequest, match="n = 1"):
        apply({}, VOCAB, True, 2, False, [1], p)
    with pytest.raises(BadRequest, match="stream"):
        apply(raw, VOCAB, False, 1, False, [1], p)
    assert resume_args(Continuation()) == {}
    assert resume_args(Continuation((7,), 1)) == {"continued": (7,), "sent_chars": 1}


def test_the_text_the_client_has() -> None:
    tok = load_tokenizer("dsv4-tiny")
    ids = tok.encode("héllo")  # byte tokens: é is two of them
    assert sent_text(tok, Continuation(tuple(ids), 5), True) == "héllo"
    assert sent_text(tok, Continuation(tuple(ids), 3), True) == "hél"  # the rest held back
    # a cut inside é: its first byte has no text yet
    assert sent_text(tok, Continuation(tuple(ids[:2]), 1), True) == "h"


def _blocks(s: str) -> list[dict[str, object]]:
    return [json.loads(b[len(": dsv4 ") :]) for b in s.split("\n\n") if b.startswith(": dsv4 ")]


def test_state_blocks() -> None:
    off = StateWriter.of(None, "c-1", 5)
    assert off.wrap("data: x\n\n", [1], "x", False) == "data: x\n\n"
    w = StateWriter.of(Continuation(), "c-1", 5)
    first = w.wrap("data: x\n\n", [1, 2], "ab", False)
    assert first.startswith(": dsv4 ") and "data: x\n\n" in first
    assert _blocks(first) == [
        {"t": [], "c": 0, "id": "c-1", "created": 5},
        {"t": [1, 2], "c": 2},
    ]
    assert _blocks(w.wrap("", [3], "", True)) == [{"t": [3], "c": 2, "f": 1}]
    resumed = StateWriter.of(Continuation((1, 2), 2, "c-1", 5), "c-9", 6)
    assert _blocks(resumed.wrap("data: y\n\n", [3], "y", False)) == [{"t": [3], "c": 3}]


def test_a_seed_moves_on_by_the_tokens_already_drawn() -> None:
    assert position_seed(5, 0) == 5
    assert position_seed(position_seed(5, 3), 4) == position_seed(5, 7)
    assert len({position_seed(5, i) for i in range(1000)}) == 1000
    assert all(0 <= position_seed(2**63 - 1, i) < 2**63 for i in range(10))
    got = remaining(SamplingParams(max_tokens=10, seed=5), Continuation((1, 2, 3)))
    assert got.seed == position_seed(5, 3)
    assert remaining(SamplingParams(max_tokens=10), Continuation((1,))).seed is None
