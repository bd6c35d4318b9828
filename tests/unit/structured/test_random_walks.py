"""Every schema of the corpus, walked at random under its mask: each finished walk validates."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest

from dsv4_serving.structured.backend import GrammarMatcher, bitmask_words
from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend
from dsv4_serving.structured.schema_corpus import schemas
from dsv4_serving.structured.spec import spec_from_request

pytestmark = pytest.mark.unit

CORPUS: list[dict[str, Any]] = schemas()
SEEDS = tuple(range(8))
FREE_STEPS = 48  # then the walk prefers tokens that close something
CAP = 1500


def allowed_ids(matcher: GrammarMatcher, vocab: int) -> np.ndarray:
    row = np.zeros(bitmask_words(vocab), dtype=np.int32)
    matcher.fill_bitmask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def walk(matcher: GrammarMatcher, vocab: int, eos: int, seed: int) -> tuple[list[int], bool]:
    rng = random.Random(seed)
    closers = {eos, ord("}"), ord("]"), ord('"')}
    out: list[int] = []
    while not matcher.is_terminated() and len(out) < CAP:
        allowed = [int(t) for t in allowed_ids(matcher, vocab)]
        assert allowed, matcher.error()
        if len(out) >= FREE_STEPS:
            allowed = [t for t in allowed if t in closers] or allowed
        token = rng.choice(allowed)
        assert matcher.accept(token), matcher.error()
        out.append(token)
    return out, matcher.is_terminated()


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_walks_validate(
    case: dict[str, Any], backend: LLGuidanceBackend, eos_id: int, tokenizer: Any
) -> None:
    spec = spec_from_request(
        {
            "type": "json_schema",
            "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True},
        }
    )
    assert spec is not None
    grammar = backend.compile(spec)
    finished = 0
    for seed in SEEDS:
        tokens, done = walk(grammar.matcher(), backend.vocab_size, eos_id, seed)
        if not done:
            continue
        finished += 1
        # the chat markers are text (as in V4's tokenizer), so a string may hold one
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert eos_id not in tokens[:-1]
        jsonschema.validate(
            json.loads(text), case["schema"], format_checker=jsonschema.FormatChecker()
        )
    print(f"{case['name']}: {finished}/{len(SEEDS)} walks terminated")
    assert finished == len(SEEDS)


def test_corpus_covers_the_issue() -> None:
    text = json.dumps(CORPUS)
    assert len(CORPUS) >= 20
    for keyword in (
        "$defs",
        "anyOf",
        "enum",
        "minimum",
        "maximum",
        "required",
        "pattern",
        '"null"',
        "items",
    ):
        assert keyword in text, keyword


def test_json_object_walks(backend: LLGuidanceBackend, eos_id: int, tokenizer: Any) -> None:
    spec = spec_from_request({"type": "json_object"})
    assert spec is not None
    grammar = backend.compile(spec)
    for seed in range(5):
        tokens, done = walk(grammar.matcher(), backend.vocab_size, eos_id, seed)
        assert done
        assert isinstance(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), dict)
