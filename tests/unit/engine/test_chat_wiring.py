"""/v1/chat/completions in DeepSeek V4's format, over a fake engine that answers a fixed token
stream: the prompt is the encoder's, the output comes back as reasoning_content, content and
tool_calls, and a stream cut at every token boundary adds up to the non-streamed answer."""

# DeepSeek's markers are spelled with U+FF5C
# ruff: noqa: RUF001
from __future__ import annotations

import itertools
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dsv4_serving.chat import dsml, encoding_v4
from dsv4_serving.chat.messages import EncodeOptions
from dsv4_serving.engine.engine.async_llm import RequestOutput
from dsv4_serving.engine.engine.messages import EngineInfo
from dsv4_serving.engine.engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
)
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.entrypoints.api_server import build_app
from dsv4_serving.entrypoints.metrics import EngineMetrics

TOK = load_tokenizer("dsv4-tiny")
MSG = [{"role": "user", "content": "weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def invoke(city: str, name: str = "get_weather") -> str:
    param = f'<｜DSML｜parameter name="city" string="true">{city}</｜DSML｜parameter>'
    return f'<｜DSML｜invoke name="{name}">\n{param}\n</｜DSML｜invoke>'


def calls(*invokes: str) -> str:
    return "\n\n<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


REASONED = "Let me think.</think>It is sunny." + dsml.EOS
CALLED = "Ask the tool.</think>Checking." + calls(invoke("Paris")) + dsml.EOS
TWO_CALLS = "</think>" + calls(invoke("Paris"), invoke("Rome")) + dsml.EOS


@dataclass
class ScriptedEngine:
    """Answers every request with ``script``'s tokens, in increments cut at ``cuts``, decoded
    the way the engine decodes them (with special tokens when the request asks)."""

    tokenizer: Tokenizer
    chat_format: str = "deepseek_v4"
    info: EngineInfo = field(
        default_factory=lambda: EngineInfo(8192, TOK.vocab_size, 257, 16, 100, 0, "fake")
    )
    config: Any = None
    script: list[int] = field(default_factory=list)
    cuts: list[int] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = SimpleNamespace(
            model="dsv4-tiny",
            role="both",
            kv_sidecar=None,
            shutdown_timeout=1.0,
            otlp_traces_endpoint=None,
            chat_format=self.chat_format,
            default_thinking="on",
        )

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-1"

    async def generate(
        self, ids: list[int], sp: SamplingParams, rid: str, *_: Any, **__: Any
    ) -> AsyncIterator[RequestOutput]:
        self.prompts.append(list(ids))
        detok = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens)
        bounds = [0, *self.cuts, len(self.script)]
        for a, b in itertools.pairwise(bounds):
            final = b == len(self.script)
            before = detok.text
            text = detok.add(self.script[a:b], final)
            reason = "stop" if final else None
            yield RequestOutput(
                rid, text[len(before) :], self.script[a:b], None, len(ids), b, 0, final, reason
            )


def _client(chat_format: str = "deepseek_v4") -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(TOK, chat_format)
    app = build_app(engine, TOK, "m", EngineMetrics(engine))  # type: ignore[arg-type]
    return TestClient(app), engine


@pytest.fixture(scope="module")
def served() -> tuple[TestClient, ScriptedEngine]:
    return _client()


def _ask(
    served: tuple[TestClient, ScriptedEngine],
    output: str,
    cuts: list[int] | None = None,
    **body: Any,
) -> Any:
    client, engine = served
    engine.script, engine.cuts = TOK.encode(output), cuts or []
    r = client.post("/v1/chat/completions", json={"messages": MSG, **body})
    assert r.status_code == 200, r.text
    return r


def _streamed(r: Any) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
    """The message a client assembles from the deltas, the finish reason, and the usage."""
    msg: dict[str, Any] = {"reasoning_content": "", "content": "", "tool_calls": {}}
    finish, usage = None, None
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            d = c["delta"]
            finish = c["finish_reason"] or finish
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            msg["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                known = msg["tool_calls"].get(tc["index"])
                if known is None:  # the first delta of a call: id, type, name, ""
                    assert tc["type"] == "function" and tc["function"]["arguments"] == ""
                    msg["tool_calls"][tc["index"]] = {
                        "id": tc["id"],
                        "type": "function",
                        "function": {"name": tc["function"]["name"], "arguments": ""},
                    }
                else:
                    assert "id" not in tc and "name" not in tc["function"]
                    known["function"]["arguments"] += tc["function"]["arguments"]
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return msg, finish, usage


def _normal(msg: dict[str, Any]) -> dict[str, Any]:
    return {
        "reasoning_content": msg.get("reasoning_content") or "",
        "content": msg.get("content") or "",
        "tool_calls": msg.get("tool_calls") or [],
    }


def test_thinking_output_is_reasoning_then_content(
    served: tuple[TestClient, ScriptedEngine],
) -> None:
    body = _ask(served, REASONED).json()
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "Let me think."
    assert choice["message"]["content"] == "It is sunny."
    assert choice["finish_reason"] == "stop"
    details = body["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == len(TOK.encode("Let me think."))
    prompt = encoding_v4.encode(MSG, EncodeOptions(thinking=True))
    assert served[1].prompts[-1] == TOK.encode(prompt)
    assert prompt.endswith(dsml.ASSISTANT + dsml.THINK_OPEN)


@pytest.mark.parametrize(
    "switch",
    [
        {"thinking": {"type": "disabled"}},
        {"chat_template_kwargs": {"thinking": False}},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ],
)
def test_chat_mode_closes_the_think_block_and_answers_content(
    served: tuple[TestClient, ScriptedEngine], switch: dict[str, Any]
) -> None:
    msg = _ask(served, "Hello." + dsml.EOS, **switch).json()["choices"][0]["message"]
    assert msg["content"] == "Hello." and msg["reasoning_content"] is None
    prompt = encoding_v4.encode(MSG, EncodeOptions(thinking=False))
    assert served[1].prompts[-1] == TOK.encode(prompt)


def test_a_tool_call_comes_back_as_tool_calls(served: tuple[TestClient, ScriptedEngine]) -> None:
    choice = _ask(served, CALLED, tools=TOOLS).json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert (msg["reasoning_content"], msg["content"]) == ("Ask the tool.", "Checking.")
    (call,) = msg["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    prompt = encoding_v4.encode(MSG, EncodeOptions(thinking=True, tools=TOOLS))
    assert served[1].prompts[-1] == TOK.encode(prompt)


def test_tool_choice_none_leaves_the_markup_as_content(
    served: tuple[TestClient, ScriptedEngine],
) -> None:
    choice = _ask(served, CALLED, tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "Checking." + calls(invoke("Paris"))


def test_parallel_tool_calls_false_keeps_the_first_call(
    served: tuple[TestClient, ScriptedEngine],
) -> None:
    msg = _ask(served, TWO_CALLS, tools=TOOLS).json()["choices"][0]["message"]
    assert len(msg["tool_calls"]) == 2
    for stream in (False, True):
        r = _ask(served, TWO_CALLS, tools=TOOLS, parallel_tool_calls=False, stream=stream)
        got = _streamed(r)[0] if stream else r.json()["choices"][0]["message"]
        (call,) = got["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def _cuttings(n: int) -> list[list[int]]:
    """Every 2-way cut, one token per increment, and random 3- and 5-way cuts."""
    rng = random.Random(0)
    out = [[i] for i in range(1, n)] + [list(range(1, n))]
    for k in (2, 4):
        out += [sorted(rng.sample(range(1, n), k)) for _ in range(20)]
    return out


@pytest.mark.parametrize(
    ("output", "body"),
    [(REASONED, {}), (CALLED, {"tools": TOOLS}), (TWO_CALLS, {"tools": TOOLS})],
    ids=["reasoning", "call", "two-calls"],
)
def test_streamed_deltas_add_up_to_the_answer_for_every_cut(
    served: tuple[TestClient, ScriptedEngine], output: str, body: dict[str, Any]
) -> None:
    whole = _ask(served, output, **body).json()
    want = _normal(whole["choices"][0]["message"])
    n = len(TOK.encode(output))
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    for cuts in _cuttings(n):
        msg, finish, usage = _streamed(_ask(served, output, cuts, **body, **opts))
        assert msg == want, cuts
        assert finish == whole["choices"][0]["finish_reason"]
        assert usage == whole["usage"]


def test_a_tool_turn_is_encoded_as_the_encoder_renders_it(
    served: tuple[TestClient, ScriptedEngine],
) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *MSG,
        {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    _ask(served, REASONED, messages=messages, tools=TOOLS)
    prompt = encoding_v4.encode(messages, EncodeOptions(thinking=True, tools=TOOLS))
    assert served[1].prompts[-1] == TOK.encode(prompt)
    assert "<tool_result>sunny</tool_result>" in prompt


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
        ({"chat_template_kwargs": {"drop_thinking": 1}}, "chat_template_kwargs.drop_thinking"),
        ({"thinking": {"type": "maybe"}}, "thinking"),
        ({"reasoning_effort": "huge"}, "reasoning_effort"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice",
        ),
    ],
)
def test_bad_switches_and_tools_are_a_400_naming_them(
    served: tuple[TestClient, ScriptedEngine], body: dict[str, Any], param: str
) -> None:
    r = served[0].post("/v1/chat/completions", json={"messages": MSG, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param == "chat_template_kwargs":
        assert "foo" in err["message"]
    if param == "tool_choice":
        assert "requires tools" in err["message"]


def test_a_jinja_model_refuses_deepseek_fields_and_answers_plain_content() -> None:
    client, engine = _client("jinja")
    engine.script = TOK.encode("a</think>b")
    r = client.post("/v1/chat/completions", json={"messages": MSG})
    # content as the model wrote it: </think> is text there (not a special token), as in V4's
    msg = r.json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "a</think>b"}
    for name, value in (("tools", TOOLS), ("thinking", {"type": "enabled"})):
        r = client.post("/v1/chat/completions", json={"messages": MSG, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name
