"""No silent ignore: every field of OpenAI's chat and completions requests (openai SDK 3.57's
``CompletionCreateParams``) is honoured, a documented no-op, or refused with a 400 in
OpenAI's error shape naming it. Run against the FastAPI app over a fake engine that records
the sampling parameters it was given."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dsv4_serving.engine.engine.async_llm import RequestOutput
from dsv4_serving.engine.engine.messages import EngineInfo
from dsv4_serving.engine.engine.tokenizer import load_tokenizer
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.entrypoints.api_server import build_app
from dsv4_serving.entrypoints.fields import NO_OPS
from dsv4_serving.entrypoints.metrics import EngineMetrics

VOCAB = 512  # the tiny tokenizer: 256 bytes, then special tokens
EOS = 257  # its end of sentence
MSG = [{"role": "user", "content": "hi"}]


@dataclass
class FakeEngine:
    """Answers every request with the token "o"; keeps the last sampling parameters."""

    info: EngineInfo = field(
        default_factory=lambda: EngineInfo(4096, VOCAB, EOS, 16, 100, 0, "fake")
    )
    config: Any = field(
        default_factory=lambda: SimpleNamespace(
            model="m",
            role="both",
            kv_sidecar=None,
            shutdown_timeout=1.0,
            otlp_traces_endpoint=None,
            chat_format="deepseek_v4",  # the fields of DeepSeek's format are honoured
            default_thinking="on",
        )
    )
    last: SamplingParams | None = None

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-1"

    async def generate(
        self, ids: list[int], sp: SamplingParams, *_: Any, **__: Any
    ) -> AsyncIterator[Any]:
        self.last = sp
        yield RequestOutput("r", "o", [ord("o")], None, len(ids), 1, 0, True, "length")


@pytest.fixture(scope="module")
def app() -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine()
    tok = load_tokenizer("dsv4-tiny")
    fastapi_app = build_app(engine, tok, "m", EngineMetrics(engine))  # type: ignore[arg-type]
    return TestClient(fastapi_app), engine


CHAT_HONOURED: dict[str, Any] = {
    "messages": MSG,
    "model": "m",
    "n": 2,
    "seed": 3,
    "stop": ["x"],
    "stream": False,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "top_p": 0.9,
    "logprobs": True,
    "top_logprobs": 2,
    "max_tokens": 5,
    "max_completion_tokens": 5,
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "logit_bias": {"5": 10},
    "response_format": {"type": "text"},  # and JSON (test_grammar_fields_reach_the_engine)
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",  # and required, named (test_grammar_fields_reach_the_engine)
    "parallel_tool_calls": False,
    "reasoning_effort": "high",
    "thinking": {"type": "enabled"},  # DeepSeek's
    "chat_template_kwargs": {"thinking": True},  # vLLM's
}
CHAT_NO_OPS: dict[str, Any] = {
    "user": "u",
    "metadata": {"k": "v"},
    "store": False,
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"},
    "service_tier": "auto",  # auto/default only
    "modalities": ["text"],  # ["text"] only
    "verbosity": "medium",  # medium only
}
CHAT_REFUSED: dict[str, Any] = {
    "tools": [{"type": "custom", "custom": {"name": "f"}}],
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "mp3"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "service_tier": "priority",
    "verbosity": "high",
    "moderation": {"input": {"mode": "block"}},
}
COMPLETION_HONOURED: dict[str, Any] = {
    "prompt": "hi",
    "model": "m",
    "n": 2,
    "seed": 3,
    "stop": "x",
    "stream": False,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "top_p": 0.9,
    "logprobs": 2,
    "max_tokens": 5,
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "logit_bias": {"5": 10},
    "echo": True,
    "best_of": 1,  # 1 only
    "suffix": "",  # empty only
}
COMPLETION_NO_OPS: dict[str, Any] = {"user": "u"}
COMPLETION_REFUSED: dict[str, Any] = {"best_of": 2, "suffix": "end"}


EXTENSIONS = {"thinking", "chat_template_kwargs"}  # DeepSeek's and vLLM's, not OpenAI's


def _openai_fields(chat: bool) -> set[str]:
    if chat:
        from openai.types.chat.completion_create_params import CompletionCreateParamsBase as C
    else:
        from openai.types.completion_create_params import CompletionCreateParamsBase as C
    return set(C.__annotations__)


@pytest.mark.parametrize("chat", [True, False])
def test_every_openai_field_is_listed_here(chat: bool) -> None:
    tables = (
        (CHAT_HONOURED, CHAT_NO_OPS, CHAT_REFUSED)
        if chat
        else (COMPLETION_HONOURED, COMPLETION_NO_OPS, COMPLETION_REFUSED)
    )
    listed = set().union(*tables) - EXTENSIONS
    assert _openai_fields(chat) | {"stream"} == listed  # (the SDK types stream per overload)
    assert set(CHAT_NO_OPS) - {"service_tier", "modalities", "verbosity"} <= NO_OPS


def _post(app: tuple[TestClient, FakeEngine], chat: bool, body: dict[str, Any]) -> Any:
    client, _ = app
    base = {"messages": MSG} if chat else {"prompt": "hi"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return client.post(path, json={**base, **body})


@pytest.mark.parametrize(
    ("chat", "name"),
    [(True, n) for n in {**CHAT_HONOURED, **CHAT_NO_OPS}]
    + [(False, n) for n in {**COMPLETION_HONOURED, **COMPLETION_NO_OPS}],
)
def test_honoured_and_no_op_fields_are_accepted(
    app: tuple[TestClient, FakeEngine], chat: bool, name: str
) -> None:
    table = (
        {**CHAT_HONOURED, **CHAT_NO_OPS} if chat else {**COMPLETION_HONOURED, **COMPLETION_NO_OPS}
    )
    body = {name: table[name]}
    if name == "echo":
        body["logprobs"] = None
    r = _post(app, chat, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("chat", "name"),
    [(True, n) for n in CHAT_REFUSED] + [(False, n) for n in COMPLETION_REFUSED],
)
def test_refused_fields_are_a_400_naming_them(
    app: tuple[TestClient, FakeEngine], chat: bool, name: str
) -> None:
    value = (CHAT_REFUSED if chat else COMPLETION_REFUSED)[name]
    r = _post(app, chat, {name: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and name in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("msg", "param"),
    [
        ({"role": "assistant", "content": "x", "prefix": True}, "prefix"),
        ({"role": "user", "content": "x", "audio": {"id": "a"}}, "audio"),
    ],
)
def test_refused_message_fields_name_the_message(
    app: tuple[TestClient, FakeEngine], msg: dict[str, Any], param: str
) -> None:
    r = _post(app, True, {"messages": [*MSG, msg]})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[1].{param}"


def test_message_no_ops_and_unknown_fields_are_accepted(
    app: tuple[TestClient, FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    msg = {"role": "user", "content": "x", "name": "bob", "reasoning_content": "r"}
    r = _post(app, True, {"messages": [msg], "no_such_field": 1})
    assert r.status_code == 200, r.text
    assert "no_such_field" in caplog.text  # ignored, with a log line (vLLM's behaviour)


def test_sampling_fields_reach_the_engine(app: tuple[TestClient, FakeEngine]) -> None:
    _, engine = app
    body = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": -100},
        "min_p": 0.1,
        "top_k": 5,
        "min_tokens": 1,
        "stop_token_ids": [9],
        "ignore_eos": True,
    }
    assert _post(app, True, body).status_code == 200
    sp = engine.last
    assert sp is not None
    got = (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.logit_bias)
    assert got == (0.5, -1.0, 1.2, {7: -100.0})
    assert (sp.min_p, sp.top_k, sp.min_tokens, sp.stop_token_ids, sp.ignore_eos) == (
        0.1,
        5,
        1,
        [9],
        True,
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"700": 1, "5": 1, "999": 2}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 2}, "min_p"),
    ],
)
def test_bad_sampling_values_are_a_400_naming_the_field(
    app: tuple[TestClient, FakeEngine], body: dict[str, Any], param: str
) -> None:
    for chat in (True, False):
        r = _post(app, chat, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    if "700" in body.get("logit_bias", {}):
        assert "[700, 999]" in r.json()["error"]["message"]


def test_echo_puts_the_prompt_before_each_choice_and_refuses_logprobs(
    app: tuple[TestClient, FakeEngine],
) -> None:
    r = _post(app, False, {"echo": True, "n": 2})
    assert [c["text"] for c in r.json()["choices"]] == ["hio", "hio"]
    r = _post(app, False, {"echo": True, "prompt": [ord("a"), ord("b")]})
    assert r.json()["choices"][0]["text"] == "abo"
    lines = _post(app, False, {"echo": True, "stream": True}).text.splitlines()
    assert '"text": "hio"' in next(line for line in lines if line.startswith("data: {"))
    r = _post(app, False, {"echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
GRAMMARS: list[tuple[bool, dict[str, Any], str]] = [
    (True, {"response_format": {"type": "json_object"}}, "json_object"),
    (
        True,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
            }
        },
        "json_schema",
    ),
    (True, {"tools": [TOOL], "tool_choice": "required"}, "tool_calls"),
    (
        True,
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_calls",
    ),
    (True, {"structured_outputs": {"choice": ["x", "y"]}}, "choice"),
    (False, {"response_format": {"type": "json_object"}}, "json_object"),
    (False, {"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
    (False, {"structured_outputs": {"grammar": 'start: "x"'}}, "lark"),
]


@pytest.mark.parametrize(("chat", "body", "kind"), GRAMMARS)
def test_grammar_fields_reach_the_engine(
    app: tuple[TestClient, FakeEngine], chat: bool, body: dict[str, Any], kind: str
) -> None:
    r = _post(app, chat, {**body, "thinking": {"type": "disabled"}} if chat else body)
    assert r.status_code == 200, r.text
    spec = app[1].last.structured if app[1].last is not None else None
    assert spec is not None and spec.kind.value == kind and not spec.reasoning


def test_thinking_puts_reasoning_before_the_grammar(app: tuple[TestClient, FakeEngine]) -> None:
    r = _post(app, True, {"response_format": {"type": "json_object"}})  # thinking: the default
    assert r.status_code == 200, r.text
    assert app[1].last is not None and app[1].last.structured is not None
    assert app[1].last.structured.reasoning


@pytest.mark.parametrize(
    ("chat", "body", "param", "words"),
    [
        (
            True,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "frob"}},
                }
            },
            "response_format.json_schema.schema",
            "frob",
        ),
        (True, {"response_format": {"type": "xml"}}, "response_format.type", "xml"),
        (
            True,
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "'g'",
        ),
        (
            True,
            {
                "tools": [TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "tool_choice",
        ),
        (
            False,
            {"structured_outputs": {"grammar": "start: nope"}},
            "structured_outputs.grammar",
            "nope",
        ),
        (
            True,
            {"thinking": {"type": "enabled"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            "thinking",
        ),
    ],
)
def test_bad_grammars_are_a_400_naming_the_field(
    app: tuple[TestClient, FakeEngine], chat: bool, body: dict[str, Any], param: str, words: str
) -> None:
    r = _post(app, chat, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["code"] == "invalid_grammar"
