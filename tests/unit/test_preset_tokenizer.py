"""The tiny presets' tokenizer speaks DeepSeek V4's format: each marker the encoder writes is one
id, decodes back byte for byte, and ``skip_special_tokens`` drops BOS and EOS only."""

# DeepSeek's markers are spelled with U+FF5C and U+2581 on purpose
# ruff: noqa: RUF001
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsv4_serving.chat import dsml, encoding_v4
from dsv4_serving.chat.messages import EncodeOptions
from dsv4_serving.chat.output_parser import parse
from dsv4_serving.engine.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from dsv4_serving.presets import PRESETS, build_tokenizer, preset_config, write_preset
from dsv4_serving.presets.configs import SPECIAL_TOKENS

TOK = build_tokenizer()
# the ids are those of the real V4 tokenizer's added tokens, in its order, after the 256 bytes
IDS = {
    dsml.BOS: 256,
    dsml.EOS: 257,
    dsml.USER: 258,
    dsml.ASSISTANT: 259,
    dsml.THINK_OPEN: 260,
    dsml.THINK_CLOSE: 261,
    dsml.DSML: 262,
    "<｜latest_reminder｜>": 263,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
}
CHAT: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"},
    {"role": "user", "content": "and tomorrow?"},
]


def _ids(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False).ids)


def test_the_added_tokens_are_v4s_markers_in_its_order() -> None:
    assert list(SPECIAL_TOKENS) == list(IDS)
    assert {t: TOK.token_to_id(t) for t in IDS} == IDS
    for name in PRESETS:
        assert preset_config(name)["vocab_size"] == TOK.get_vocab_size() == 264


@pytest.mark.parametrize("marker", list(IDS))
def test_each_marker_is_one_id_and_decodes_back_exactly(marker: str) -> None:
    assert _ids(marker) == [IDS[marker]]
    assert TOK.decode([IDS[marker]], skip_special_tokens=False) == marker
    kept = marker not in (dsml.BOS, dsml.EOS)
    assert TOK.decode([IDS[marker]], skip_special_tokens=True) == (marker if kept else "")


def test_dsml_tags_are_a_byte_then_the_marker_as_in_v4() -> None:
    lt, slash = ord("<"), ord("/")
    assert _ids(dsml.block_open(dsml.V4_BLOCK))[:2] == [lt, IDS[dsml.DSML]]
    assert _ids(dsml.INVOKE_CLOSE)[:3] == [lt, slash, IDS[dsml.DSML]]
    assert _ids("a｜DSMLb") == _ids("a") + list("｜DSMLb".encode()) and "｜DSMLb" not in IDS


def test_a_multi_turn_tool_chat_encodes_each_marker_as_its_id_and_round_trips() -> None:
    text = encoding_v4.encode(CHAT, EncodeOptions(thinking=True, tools=TOOLS))
    ids = _ids(text)
    assert TOK.decode(ids, skip_special_tokens=False) == text
    for marker, tid in IDS.items():
        assert ids.count(tid) == text.count(marker), marker
    assert all(ids.count(IDS[m]) > 0 for m in (dsml.USER, dsml.THINK_CLOSE, dsml.DSML, dsml.EOS))
    assert ids[0] == IDS[dsml.BOS] and ids[-1] == IDS[dsml.THINK_OPEN]
    # skip_special_tokens drops BOS and the EOS of each assistant turn, nothing else
    assert TOK.decode(ids, skip_special_tokens=True) == text.replace(dsml.BOS, "").replace(
        dsml.EOS, ""
    )


def test_an_assistant_turn_decoded_token_by_token_parses_into_its_call() -> None:
    """The engine's detokenizer (special tokens kept) feeds the parser one id at a time."""
    answer = "the weather</think>Checking." + encoding_v4.render_assistant(
        {"role": "assistant", "content": "", "tool_calls": [CALL]}, "m", False
    )
    ids = _ids(answer)
    assert IDS[dsml.THINK_CLOSE] in ids and IDS[dsml.DSML] in ids and ids[-1] == IDS[dsml.EOS]
    detok = IncrementalDetokenizer(load_tokenizer("dsv4-tiny"), skip_special_tokens=False)
    for i, tid in enumerate(ids):
        detok.add([tid], final=i == len(ids) - 1)
    got = parse(detok.text, thinking=True, tool_names={"get_weather"}, new_id=lambda i: "c")
    assert (got.reasoning, got.content) == ("the weather", "Checking.")
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]


def test_the_written_preset_tokenizer_is_the_same(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    write_preset("dsv4-tiny", tmp_path)
    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = encoding_v4.encode(CHAT, EncodeOptions(thinking=False, tools=TOOLS))
    assert loaded.encode(text, add_special_tokens=False).ids == _ids(text)
    assert loaded.decode([IDS[dsml.DSML], IDS[dsml.EOS]], skip_special_tokens=True) == dsml.DSML
