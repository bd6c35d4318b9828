"""Structured-output requests the engine and gateway tiers both send: the biases a random-weight
model needs to close what it opens, the tools, one JSON request per schema, and an
openai-agents tool loop.

A random-weight model rambles: the requests bias the tokens that close things (quotes,
brackets, ``<``), which the grammar's mask still rules (a bias never un-masks a token)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

EOS, THINK_CLOSE = 257, 261  # the tiny tokenizer's special tokens
# a JSON string ends at '"' (above '}' and ']', which a string may hold); a raw DSML string
# ends at '<' (above '"', which it may hold)
JSON_BIAS = {str(ord('"')): 10.0, str(ord("}")): 5.0, str(ord("]")): 5.0, str(THINK_CLOSE): 12.0}
TOOL_BIAS = {str(ord("<")): 10.0, str(ord("}")): 5.0, str(ord("]")): 5.0, str(ord('"')): 3.0}
NO_THINKING = {"thinking": {"type": "disabled"}}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=600)


def ask_json(base_url: str, model: str, case: dict[str, Any], extra: dict[str, Any]) -> Any:
    """One greedy chat answer under ``case``'s schema (strict json_schema): its first choice."""
    return (
        client(base_url)
        .chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Give me a {case['name']} as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True},
            },
            temperature=0,
            max_tokens=600,
            logit_bias=JSON_BIAS,
            extra_body=extra,
        )
        .choices[0]
    )


def agent_three_turns(base_url: str, model_name: str) -> tuple[list[tuple[str, int]], Any]:
    """openai-agents (PyPI): a forced tool call (``tool_choice: required``), the tool's result,
    then an answer (the SDK resets tool_choice after a tool use). (the tool's calls, result)"""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[tuple[str, int]] = []

    @function_tool
    def weather(city: str, days: int) -> str:
        """The forecast for a city."""
        seen.append((city, days))
        return f"sunny in {city} for {days} days"

    model = OpenAIChatCompletionsModel(
        model=model_name,
        openai_client=openai.AsyncOpenAI(
            base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=600
        ),
    )
    agent = Agent(
        name="forecaster",
        instructions="Answer with the forecast.",
        tools=[weather],
        model=model,
        model_settings=ModelSettings(
            tool_choice="required",
            temperature=0,
            max_tokens=500,
            extra_body={**NO_THINKING, "logit_bias": TOOL_BIAS},
        ),
    )
    result = asyncio.run(Runner.run(agent, "Weather in Paris for 3 days?", max_turns=3))
    return seen, result


def assert_three_turns(seen: list[tuple[str, int]], result: Any) -> None:
    """One tool call with typed arguments, its output, then a final message."""
    assert len(seen) == 1 and isinstance(seen[0][0], str) and isinstance(seen[0][1], int)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)
