"""Tool-call grammars, reasoning before a grammar, and vLLM's structured_outputs kinds, walked
at random under their masks: every finished walk is what the request asked for."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest

from dsv4_serving.chat.output_parser import parse
from dsv4_serving.structured.backend import GrammarMatcher, bitmask_words
from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend
from dsv4_serving.structured.spec import GrammarSpec, GrammarSpecError, spec_from_request

pytestmark = pytest.mark.unit

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "where": {"$ref": "#/$defs/point"},
    },
    "required": ["city", "days"],
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"lat": {"type": "number"}},
            "required": ["lat"],
            "additionalProperties": False,
        }
    },
}
SEARCH = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "now"}},
]
SCHEMAS = {"weather": WEATHER, "search": SEARCH, "now": {"type": "object"}}
CLOSERS = {ord(c) for c in '<"}]'}


def walk(m: GrammarMatcher, backend: LLGuidanceBackend, eos: int, seed: int) -> list[int]:
    """Random allowed tokens; after a while, closers first (so walks end)."""
    rng = random.Random(seed)
    vocab = backend.vocab_size
    out: list[int] = []
    while not m.is_terminated():
        assert len(out) < 3000, "the walk did not end"
        row = np.zeros(bitmask_words(vocab), dtype=np.int32)
        m.fill_bitmask(row)
        allowed = [
            int(t)
            for t in np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])
        ]
        assert allowed, m.error()
        if len(out) > 40:
            allowed = [t for t in allowed if t in CLOSERS | {eos, 261}] or allowed
        t = rng.choice(allowed)
        assert m.accept(t), m.error()
        out.append(t)
    return out


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "weather"}}]
)
@pytest.mark.parametrize("reasoning", [False, True])
def test_tool_call_walks_parse_and_validate(
    choice: Any, reasoning: bool, backend: LLGuidanceBackend, tokenizer: Any, eos_id: int
) -> None:
    spec = spec_from_request(None, TOOLS, choice)
    assert spec is not None
    spec = GrammarSpec(**{**spec.__dict__, "reasoning": reasoning})
    grammar = backend.compile(spec)
    names = set()
    for seed in range(6):
        text = tokenizer.decode(
            walk(grammar.matcher(), backend, eos_id, seed), skip_special_tokens=False
        )
        msg = parse(text, thinking=reasoning, tool_names=set(SCHEMAS))
        assert msg.tool_calls, text
        assert not (msg.content or "").strip(), text
        for call in msg.tool_calls:
            names.add(call.name)
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert names <= ({"weather"} if isinstance(choice, dict) else set(SCHEMAS))


def test_not_parallel_is_one_call(backend: LLGuidanceBackend, tokenizer: Any, eos_id: int) -> None:
    spec = spec_from_request(None, TOOLS, "required", parallel_tool_calls=False)
    assert spec is not None
    grammar = backend.compile(spec)
    for seed in range(4):
        text = tokenizer.decode(
            walk(grammar.matcher(), backend, eos_id, seed), skip_special_tokens=False
        )
        assert len(parse(text, thinking=False).tool_calls) == 1


def test_reasoning_then_json(backend: LLGuidanceBackend, tokenizer: Any, eos_id: int) -> None:
    base = spec_from_request(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    )
    assert base is not None
    spec = GrammarSpec(**{**base.__dict__, "reasoning": True})
    m = backend.compile(spec).matcher()
    for t in tokenizer.encode("I think {", add_special_tokens=False).ids:
        assert m.accept(t)
    for seed in range(4):
        text = tokenizer.decode(
            walk(backend.compile(spec).matcher(), backend, eos_id, seed), skip_special_tokens=False
        )
        msg = parse(text, thinking=True)
        jsonschema.validate(json.loads(msg.content), WEATHER)


@pytest.mark.parametrize(
    ("so", "check"),
    [
        (
            {"choice": ["yes", "no", 'a "quoted" one']},
            lambda s: s in ("yes", "no", 'a "quoted" one'),
        ),
        ({"regex": "[a-c]{2,4}"}, lambda s: 2 <= len(s) <= 4 and set(s) <= set("abc")),
        (
            {"grammar": 'start: "x" NUM\nNUM: /[0-9]{1,3}/'},
            lambda s: s[0] == "x" and s[1:].isdigit(),
        ),
        (
            {"json": json.dumps(SEARCH)},
            lambda s: jsonschema.validate(json.loads(s), SEARCH) is None,
        ),
        ({"json_object": True}, lambda s: isinstance(json.loads(s), dict)),
    ],
)
def test_structured_outputs_kinds(
    so: dict[str, Any], check: Any, backend: LLGuidanceBackend, tokenizer: Any, eos_id: int
) -> None:
    spec = spec_from_request(structured_outputs=so)
    assert spec is not None
    grammar = backend.compile(spec)
    for seed in range(4):
        tokens = walk(grammar.matcher(), backend, eos_id, seed)
        assert check(tokenizer.decode([t for t in tokens if t != eos_id]))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs.json"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
)
def test_structured_outputs_refusals(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GrammarSpecError) as info:
        spec_from_request(**kwargs)
    assert info.value.field == field


def test_bad_lark_and_regex_name_the_field(backend: LLGuidanceBackend) -> None:
    for so, field in (
        ({"grammar": "start: nope"}, "structured_outputs.grammar"),
        ({"regex": "(["}, "structured_outputs.regex"),
    ):
        spec = spec_from_request(structured_outputs=so)
        assert spec is not None
        with pytest.raises(GrammarSpecError) as info:
            backend.check(spec)
        assert info.value.field == field
