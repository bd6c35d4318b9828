"""Structured outputs from real engine processes (random-weight tiny models, openai SDK): every
schema of the corpus gives JSON that validates, on dsv4-tiny and dsv3-small, with MTP on and
off (greedy tokens equal), after reasoning in thinking mode; tool_choice required and named give
tool calls whose arguments validate; aborted grammar requests leave nothing behind.

A random-weight model rambles: the requests bias what closes things (tests/structured_requests)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from dsv4_common.process import Service
from dsv4_serving.structured.schema_corpus import schemas
from tests import structured_requests
from tests.engine.common import start_engine
from tests.engine.test_openai_api import wait_blocks_free
from tests.structured_requests import (
    NO_THINKING,
    THINK_CLOSE,
    TOOL_BIAS,
    TOOL_SCHEMAS,
    TOOLS,
    agent_three_turns,
    assert_three_turns,
)

CORPUS = schemas()
SERVERS: dict[str, tuple[str, int, dict[str, Any], tuple[str, ...]]] = {
    # name: (model, speculative tokens, the request's switches, more engine flags)
    "tiny": ("dsv4-tiny", 0, NO_THINKING, ()),
    "tiny-mtp": ("dsv4-tiny", 2, NO_THINKING, ()),
    # TP rank 0 samples, so it alone holds the grammars: the same greedy JSON as one rank
    "tiny-tp2": ("dsv4-tiny", 0, NO_THINKING, ("--tensor-parallel-size", "2")),
    # its chat format decides whether it thinks; the biased </think> ends reasoning early
    "small-mtp": ("dsv3-small", 1, {}, ()),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    started: dict[str, Service] = {}
    log_dir: Path = tmp_path_factory.mktemp("structured")
    try:
        for name, (model, k, _, flags) in SERVERS.items():
            started[name] = start_engine(
                name,
                log_dir,
                "--model",
                model,
                "--served-model-name",
                "m",
                "--max-model-len",
                "3072",
                "--num-kv-blocks",
                "1600",
                "--num-speculative-tokens",
                str(k),
                *flags,
            )
        for s in started.values():
            s.wait_ready(300)
        yield started
    finally:
        for s in started.values():
            s.stop()


def client(server: Service) -> openai.OpenAI:
    return structured_requests.client(server.url)


def ask_json(server: Service, case: dict[str, Any], extra: dict[str, Any]) -> Any:
    return structured_requests.ask_json(server.url, "m", case, extra)


def corpus_answers(server: Service, extra: dict[str, Any]) -> list[Any]:
    with ThreadPoolExecutor(len(CORPUS)) as pool:
        return list(pool.map(lambda c: ask_json(server, c, extra), CORPUS))


@pytest.fixture(scope="module")
def answers(servers: dict[str, Service]) -> dict[str, list[Any]]:
    return {name: corpus_answers(s, SERVERS[name][2]) for name, s in servers.items()}


@pytest.mark.parametrize("name", list(SERVERS))
def test_every_schema_validates(answers: dict[str, list[Any]], name: str) -> None:
    for case, choice in zip(CORPUS, answers[name], strict=True):
        assert choice.finish_reason == "stop", (case["name"], choice.message.content)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, case["schema"], format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name", ["tiny-mtp", "tiny-tp2"])
def test_mtp_and_tp_give_the_same_greedy_json(answers: dict[str, list[Any]], name: str) -> None:
    plain = [c.message.content for c in answers["tiny"]]
    assert plain == [c.message.content for c in answers[name]]


def test_reasoning_comes_before_the_json(servers: dict[str, Service]) -> None:
    case = next(c for c in CORPUS if c["name"] == "nested")
    choice = ask_json(
        servers["tiny-mtp"], case, {"thinking": {"type": "enabled"}, "return_token_ids": True}
    )
    # the prompt opened a think block: a JSON grammar without the reasoning prefix would mask
    # </think>, and the parser would file the whole answer as reasoning (content empty)
    assert choice.finish_reason == "stop"
    assert THINK_CLOSE in choice.model_extra["token_ids"]
    jsonschema.validate(json.loads(choice.message.content), case["schema"])


@pytest.mark.parametrize("name", ["tiny", "tiny-mtp"])  # tools: DeepSeek's chat format
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}]
)
def test_forced_tool_calls_validate(
    servers: dict[str, Service], name: str, tool_choice: Any
) -> None:
    for seed in range(3):
        r = client(servers[name]).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=tool_choice,
            temperature=1.0,
            seed=seed,
            max_tokens=500,
            logit_bias=TOOL_BIAS,
            extra_body=NO_THINKING,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        calls = choice.message.tool_calls or []
        assert calls and not (choice.message.content or "").strip()
        for call in calls:
            fn = call.function  # type: ignore[union-attr]
            if isinstance(tool_choice, dict):
                assert fn.name == "weather"
            jsonschema.validate(json.loads(fn.arguments), TOOL_SCHEMAS[fn.name])


def test_completions_and_vllm_structured_outputs(servers: dict[str, Service]) -> None:
    c = client(servers["tiny-mtp"])
    r = c.completions.create(
        model="m",
        prompt="Pick one:",
        max_tokens=50,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert r.choices[0].text in ("red", "green", "blue")
    r = c.completions.create(
        model="m",
        prompt="A word:",
        max_tokens=50,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{3,6}"}},
    )
    assert 3 <= len(r.choices[0].text) <= 6 and r.choices[0].text.isalpha()


def test_an_invalid_schema_is_a_400(servers: dict[str, Service]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(servers["tiny"]).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}},
            },
        )
    body: Any = info.value.body
    assert body["param"] == "response_format.json_schema.schema"


def test_aborted_grammar_requests_leave_nothing(servers: dict[str, Service]) -> None:
    """Streams cut after their first chunk: the engine frees every block (matchers go with
    their requests) and still answers the next request under a grammar."""
    server = servers["tiny-mtp"]
    c = client(server)
    for case in CORPUS[:6]:
        stream = c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "JSON please"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": case["name"], "schema": case["schema"]},
            },
            max_tokens=500,
            stream=True,
            extra_body=NO_THINKING,
        )
        next(iter(stream))
        stream.close()
    wait_blocks_free(server, 60)
    choice = ask_json(server, CORPUS[0], NO_THINKING)
    jsonschema.validate(json.loads(choice.message.content), CORPUS[0]["schema"])


def test_openai_agents_three_turn_loop(servers: dict[str, Service]) -> None:
    """openai-agents (PyPI) against the engine: call, tool result, answer."""
    assert_three_turns(*agent_three_turns(servers["tiny"].url, "m"))
