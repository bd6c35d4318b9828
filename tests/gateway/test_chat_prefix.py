"""Chat prefix affinity with the model's tokenizer, on real dsv4-tiny engines: the gateway's ids of
a multi-turn chat with tools are the engine's prompt ids (the engine's greedy answer to the
chat equals its answer to those ids as a completions prompt), and chats sharing a system prompt
and tools land on the engine that holds that prefix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsv4_common.process import Service
from dsv4_serving.chat import dsml
from dsv4_serving.gateway.prompt import load_encoder, prompt_tokens
from tests.gateway.conftest import gateway, routed_counts, running

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "full-text search over the product documentation " * 4,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "Answer from the docs."}
CALL = {
    "id": "call_7",
    "type": "function",
    "function": {"name": "search_docs", "arguments": '{"query": "install", "limit": 3}'},
}
CHAT: list[Any] = [
    SYSTEM,
    {"role": "user", "content": "How do I install it?"},
    {"role": "assistant", "content": None, "reasoning_content": "search", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_7", "content": "pip install it"},
    {"role": "assistant", "content": "Run pip.", "reasoning_content": "found"},
    {"role": "user", "content": "And upgrade?"},
]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def gw(two_engines: tuple[Service, ...]) -> Iterator[Service]:
    a, b = two_engines
    args = ("--engine", a.url, "--engine", b.url, "--tokenizer", "dsv4-tiny")
    with running(gateway("gateway-chat-prefix", *args)) as (g,):
        yield g


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/{path}", json={"model": "dsv4-tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.parametrize("switch", [{}, {"thinking": {"type": "disabled"}}], ids=["think", "chat"])
def test_the_gateways_chat_ids_are_the_engines_prompt_ids(
    two_engines: tuple[Service, ...], switch: dict[str, Any]
) -> None:
    body = {"messages": CHAT, "tools": TOOLS, **switch}
    ids = prompt_tokens(body, True, load_encoder("dsv4-tiny"))
    tok = load_encoder("dsv4-tiny")
    for marker in (dsml.BOS, dsml.USER, dsml.ASSISTANT, dsml.THINK_CLOSE, dsml.DSML, dsml.EOS):
        assert tok(marker)[0] in ids and len(tok(marker)) == 1, marker
    engine = two_engines[0].url
    chat = _post(engine, "chat/completions", {**body, **GREEDY})
    completion = _post(engine, "completions", {"prompt": ids, **GREEDY})
    assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"] == len(ids)
    assert chat["choices"][0]["token_ids"] == completion["choices"][0]["token_ids"]


def _spread(g: Service) -> list[float]:
    """How 6 chats sharing a short system prompt and the tools, each with its own question,
    spread over the engines. The text join (no tokenizer) knows no tools and shares less than a
    block between them; the rendered prompts share the whole tools block."""
    before = routed_counts(g)
    for i in range(6):
        msgs = [{"role": "system", "content": "Hi"}, {"role": "user", "content": f"{i}: how?"}]
        _post(g.url, "chat/completions", {"messages": msgs, "tools": TOOLS, "max_tokens": 2})
    after = routed_counts(g)
    return sorted(v - before.get(k, 0.0) for k, v in after.items())


def test_chats_sharing_system_prompt_and_tools_land_on_one_engine(
    gw: Service, two_engines: tuple[Service, ...]
) -> None:
    assert _spread(gw) in ([6.0], [0.0, 6.0])
    a, b = two_engines
    with running(gateway("gateway-no-tokenizer", "--engine", a.url, "--engine", b.url)) as (g,):
        assert _spread(g)[0] > 0  # no affinity: ties alternate over both engines
