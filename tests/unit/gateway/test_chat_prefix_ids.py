"""The gateway's prompt ids of a chat are the engine's: the engine's API server renders the
request (pydantic body, ``ChatRenderer``) and encodes it with its tokenizer; the gateway renders
the raw JSON body. Equal ids for every switch, tools, tool turns and message shapes; a body the
engine refuses falls back to the text join; prefixes that share system prompt and tools share
their leading block hashes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from dsv4_serving.chat import dsml
from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.engine.engine.tokenizer import load_tokenizer
from dsv4_serving.entrypoints.chat_prompt import ChatRenderer, chat_format_of
from dsv4_serving.entrypoints.protocol import ChatCompletionRequest
from dsv4_serving.gateway.prompt import (
    _text_of_messages,
    load_encoder,
    prompt_tokens,
    route_request,
)
from dsv4_serving.presets import write_preset

pytestmark = pytest.mark.unit

TOK = load_tokenizer("dsv4-tiny")
GW = load_encoder("dsv4-tiny")
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city, for the next days " * 3,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
    },
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
}
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
TURNS: list[Any] = [
    SYSTEM,
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "look it up", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "easy", "name": "bot"},
    {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "x"}]},
]
BASE = {"model": "dsv4-tiny", "messages": TURNS, "tools": TOOLS}
SWITCHES: list[dict[str, Any]] = [
    {},
    {"thinking": {"type": "disabled"}},
    {"thinking": {"type": "enabled"}},
    {"chat_template_kwargs": {"thinking": False}},
    {"chat_template_kwargs": {"enable_thinking": True, "drop_thinking": False}},
    {"reasoning_effort": "none"},
    {"reasoning_effort": "high"},
    {"reasoning_effort": "max", "tools": None},
    {"tools": [], "tool_choice": "none", "max_tokens": 3, "stream": True},
]
SHAPES: list[list[Any]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    # not an API field: the engine drops a message's own tools, so must the gateway
    [{"role": "system", "content": "s"}, {"role": "system", "content": "t", "tools": TOOLS}],
]


def engine_ids(body: dict[str, Any], default_thinking: bool = True) -> list[int]:
    renderer = ChatRenderer(chat_format_of("dsv4-tiny"), TOK, default_thinking)
    return TOK.encode(renderer.render(ChatCompletionRequest.model_validate(body)).text)


@pytest.mark.parametrize("switch", SWITCHES, ids=str)
def test_a_multi_turn_tool_chat_gets_the_engines_ids(switch: dict[str, Any]) -> None:
    body = {**copy.deepcopy(BASE), **switch}
    got = prompt_tokens(body, True, GW)
    assert got == engine_ids(body)
    assert TOK.token_id(dsml.DSML) in got or not body.get("tools")


@pytest.mark.parametrize(
    "messages", SHAPES, ids=["user", "developer", "two-users", "message-tools"]
)
def test_message_shapes_get_the_engines_ids(messages: list[Any]) -> None:
    for tools in (None, TOOLS):
        body = {"messages": messages, "tools": tools}
        assert prompt_tokens(body, True, GW) == engine_ids(body)


def test_the_default_mode_is_the_engines() -> None:
    off = load_encoder("dsv4-tiny", default_thinking=False)
    body = {"messages": TURNS[:2]}
    assert prompt_tokens(body, True, off) == engine_ids(body, default_thinking=False)
    assert prompt_tokens(body, True, off) != prompt_tokens(body, True, GW)


@pytest.mark.parametrize(
    "bad",
    [
        {"chat_template_kwargs": {"foo": 1}},
        {"thinking": "yes"},
        {"reasoning_effort": "extreme"},
        {"messages": [{"role": "latest_reminder", "content": "x"}]},
        {"messages": ["not a message"]},
        {"messages": "nope"},
    ],
)
def test_a_body_the_engine_refuses_falls_back_to_the_text_join(bad: dict[str, Any]) -> None:
    body = {**BASE, **bad}
    want = TOK.encode(_text_of_messages(body["messages"]))
    assert prompt_tokens(body, True, GW) == want


def test_jinja_models_and_no_tokenizer_keep_the_text_join() -> None:
    body = {"messages": TURNS[:2], "tools": TOOLS}
    text = _text_of_messages(body["messages"])
    assert prompt_tokens(body, True, load_encoder("dsv3-small")) == TOK.encode(text)
    assert prompt_tokens(body, True, load_encoder(None)) == list(text.encode())


def test_a_checkpoint_directory_or_its_tokenizer_json_load_the_same(tmp_path: Path) -> None:
    write_preset("dsv4-tiny", tmp_path)
    body = {**BASE, "reasoning_effort": "high"}
    want = engine_ids(body)
    for spec in (str(tmp_path), str(tmp_path / "tokenizer.json")):
        assert prompt_tokens(body, True, load_encoder(spec)) == want
    assert prompt_tokens(body, True, load_encoder(str(tmp_path), "jinja")) != want


def test_chats_sharing_system_prompt_and_tools_share_their_leading_blocks() -> None:
    a = {"messages": [SYSTEM, {"role": "user", "content": "first question"}], "tools": TOOLS}
    b = {"messages": [SYSTEM, {"role": "user", "content": "another one"}], "tools": TOOLS}
    ia, ib = prompt_tokens(a, True, GW), prompt_tokens(b, True, GW)
    common = next(i for i, (x, y) in enumerate(zip(ia, ib, strict=False)) if x != y)
    assert common > 400  # the tools block is rendered into the system part
    ha = list(route_request(a, True, GW, 16).block_hashes)
    hb = list(route_request(b, True, GW, 16).block_hashes)
    full = common // 16  # whole blocks before the first difference
    assert ha[:full] == hb[:full] and ha[full] != hb[full]
    assert ha == block_hashes(engine_ids(a), 16)
    # the text join knows no tools: the same two chats share only the system prompt's blocks
    fa = list(route_request(a, True, load_encoder(None), 16).block_hashes)
    fb = list(route_request(b, True, load_encoder(None), 16).block_hashes)
    shared = sum(1 for x, y in zip(fa, fb, strict=False) if x == y)
    assert shared < full
