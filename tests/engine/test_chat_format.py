"""DeepSeek V4's chat format on a real dsv4-tiny engine (the openai SDK as client): thinking on,
the output arrives as reasoning_content, off as content, streamed the same way; a tool turn is
accepted and encoded as the encoder renders it."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from dsv4_common.process import Service
from dsv4_serving.chat import encoding_v4
from dsv4_serving.chat.messages import EncodeOptions
from dsv4_serving.engine.engine.tokenizer import load_tokenizer

MODEL = "tiny"
ENGINE_ARGS = ["--model", "dsv4-tiny", "--served-model-name", MODEL, "--max-model-len", "2048"]
TOK = load_tokenizer("dsv4-tiny")
MSGS = [{"role": "user", "content": "hello"}]
# the random model must neither close the think block nor end the answer early
NO_CLOSE = {
    "ignore_eos": True,
    "logit_bias": {str(TOK.token_id("</think>")): -100, str(TOK.token_id(TOK.eos_token)): -100},
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


@pytest.fixture(scope="module")
def client(engine_server: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_server.url + "/v1", api_key="x", max_retries=0)


def _ask(client: openai.OpenAI, stream: bool, **extra: Any) -> tuple[str, str, Any]:
    """(reasoning, content, usage) of a greedy 8-token answer."""
    kw: dict[str, Any] = {"model": MODEL, "messages": MSGS, "max_tokens": 8, "temperature": 0}
    body = {**NO_CLOSE, **extra}
    if not stream:
        r = client.chat.completions.create(**kw, extra_body=body)
        msg = r.choices[0].message
        return getattr(msg, "reasoning_content", None) or "", msg.content or "", r.usage
    reasoning, content, usage = "", "", None
    s = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}, extra_body=body
    )
    for chunk in s:
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    return reasoning, content, usage


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_on_is_reasoning_and_off_is_content(client: openai.OpenAI, stream: bool) -> None:
    reasoning, content, usage = _ask(client, stream)  # the server's default: thinking
    assert reasoning and not content
    assert usage.completion_tokens_details.reasoning_tokens == 8
    for off in (
        {"thinking": {"type": "disabled"}},
        {"chat_template_kwargs": {"thinking": False}},
        {"reasoning_effort": "none"},
    ):
        reasoning, content, usage = _ask(client, stream, **off)
        assert content and not reasoning, off
        assert usage.completion_tokens_details.reasoning_tokens == 0


def test_streamed_reasoning_equals_the_answer(client: openai.OpenAI) -> None:
    assert _ask(client, True)[:2] == _ask(client, False)[:2]


def test_a_tool_turn_is_accepted_and_encoded_as_the_encoder_renders_it(
    client: openai.OpenAI,
) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages: list[Any] = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = encoding_v4.encode(messages, EncodeOptions(thinking=True, tools=TOOLS))
    assert r.usage is not None and r.usage.prompt_tokens == len(TOK.encode(prompt))


def test_a_tool_choice_naming_no_tool_names_the_field(client: openai.OpenAI) -> None:
    """(``required`` and named tools are grammar-constrained: tests/engine/test_structured_outputs)"""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
            max_tokens=2,
        )
    assert "'nope'" in str(e.value) and "tool_choice" in str(e.value)
