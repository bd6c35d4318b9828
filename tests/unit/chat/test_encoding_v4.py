"""V4's chat format, byte for byte, on cases written from DeepSeek's published encoder rules."""

# ruff: noqa: RUF001
from __future__ import annotations

import json
from typing import Any

import pytest

from dsv4_serving.chat import encoding_v4
from dsv4_serving.chat.effort import V4_0731, V4_PREVIEW
from dsv4_serving.chat.messages import ChatFormatError, EncodeOptions

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# DeepSeek's V4 tools text, restated here (not imported) so that a change to the encoder shows
TOOLS_BLOCK = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools"
    ' by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types'
    ' (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning"
    " inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object",'
    ' "properties": {"city": {"type": "string"}}}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool"
    " calls.\n"
)


def call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def enc(messages: list[dict[str, Any]], **kw: Any) -> str:
    return encoding_v4.encode(messages, EncodeOptions(**kw))


MULTI = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "reasoning_content": "r1", "content": "A1"},
    {"role": "user", "content": "Q2"},
]


def test_one_user_turn_in_each_mode() -> None:
    hi = [{"role": "user", "content": "Hi"}]
    assert enc(hi, thinking=True) == f"{BOS}{U}Hi{A}<think>"
    assert enc(hi, thinking=False) == f"{BOS}{U}Hi{A}</think>"


def test_thinking_drops_earlier_reasoning() -> None:
    assert enc(MULTI, thinking=True) == f"{BOS}S{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>"


def test_reasoning_kept_when_not_dropping() -> None:
    want = f"{BOS}S{U}Q1{A}<think>r1</think>A1{EOS}{U}Q2{A}<think>"
    assert enc(MULTI, thinking=True, drop_thinking=False) == want


def test_chat_mode_renders_no_reasoning() -> None:
    assert enc(MULTI, thinking=False) == f"{BOS}S{U}Q1{A}</think>A1{EOS}{U}Q2{A}</think>"


def test_vllm_reasoning_field_is_read_too() -> None:
    msgs = [dict(m) for m in MULTI]
    msgs[2] = {"role": "assistant", "reasoning": "r1", "content": "A1"}
    assert "<think>r1</think>A1" in enc(msgs, thinking=True, drop_thinking=False)


def test_earlier_developer_message_goes_in_thinking_mode_only() -> None:
    msgs = [*MULTI[:1], {"role": "developer", "content": "D"}, *MULTI[1:]]
    assert enc(msgs, thinking=True) == f"{BOS}S{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>"
    assert enc(msgs, thinking=False) == f"{BOS}S{U}D{U}Q1{A}</think>A1{EOS}{U}Q2{A}</think>"


def test_last_developer_message_opens_the_turn() -> None:
    assert enc([{"role": "developer", "content": "D"}]) == f"{BOS}{U}D{A}<think>"


@pytest.mark.parametrize(
    ("effort", "prefix"),
    [
        (None, ""),
        ("low", ""),
        ("high", "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"),
        ("max", "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"),
    ],
)
def test_each_effort_tier_prefixes_thinking_prompts(effort: str | None, prefix: str) -> None:
    out = enc(MULTI, thinking=True, effort=effort)
    assert out.startswith(BOS + prefix)
    assert out == BOS + V4_0731.prefix(effort) + f"S{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>"
    assert enc(MULTI, thinking=False, effort=effort) == enc(MULTI, thinking=False)


def test_the_preview_table_prompts_max_only() -> None:
    hi = [{"role": "user", "content": "Hi"}]
    opts = EncodeOptions(thinking=True, effort="high")
    assert encoding_v4.encode(hi, opts, V4_PREVIEW) == f"{BOS}{U}Hi{A}<think>"
    opts = EncodeOptions(thinking=True, effort="max")
    assert encoding_v4.encode(hi, opts, V4_PREVIEW).startswith(
        BOS + "Reasoning Effort: Absolute maximum"
    )


def test_a_call_then_its_result_with_tools_keeps_every_reasoning() -> None:
    msgs = [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "reasoning_content": "need it",
            "content": None,
            "tool_calls": [call("c1", "get_weather", {"city": "Paris"})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"t":21}'},
    ]
    want = (
        f"{BOS}Sys.\n\n{TOOLS_BLOCK}{U}Paris?{A}<think>need it</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}"
        f'{U}<tool_result>{{"t":21}}</tool_result>{A}<think>'
    )
    assert enc(msgs, thinking=True, tools=[WEATHER]) == want


def test_tools_without_a_system_message_open_the_prompt() -> None:
    out = enc([{"role": "user", "content": "Hi"}], thinking=False, tools=[WEATHER])
    assert out == f"{BOS}\n\n{TOOLS_BLOCK}{U}Hi{A}</think>"


def test_tools_mean_nothing_is_dropped() -> None:
    out = enc(MULTI, thinking=True, tools=[WEATHER])
    assert out == f"{BOS}S\n\n{TOOLS_BLOCK}{U}Q1{A}<think>r1</think>A1{EOS}{U}Q2{A}<think>"


def test_results_out_of_order_follow_the_calls_and_merge_with_user_text() -> None:
    msgs = [
        {"role": "user", "content": "both"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("a", "f", {"x": 1}), call("b", "f", {"x": 2})],
        },
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {
            "role": "tool",
            "tool_call_id": "a",
            "content": [{"type": "text", "text": "A"}, {"type": "image_url"}],
        },
        {"role": "user", "content": "thanks"},
    ]
    out = enc(msgs, thinking=False)
    tail = (
        f"{EOS}{U}<tool_result>A\n\n[Unsupported image_url]</tool_result>\n\n"
        f"<tool_result>B</tool_result>\n\nthanks{A}</think>"
    )
    assert out.endswith(tail)
    assert '<｜DSML｜parameter name="x" string="false">1</｜DSML｜parameter>' in out


def test_non_string_parameters_are_json() -> None:
    args = {"n": 3, "tags": ["a", "é"], "ok": True, "s": 'q"<'}
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [call("c", "f", args)]},
    ]
    out = enc(msgs, thinking=False)
    assert '<｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>' in out
    assert '<｜DSML｜parameter name="tags" string="false">["a", "é"]</｜DSML｜parameter>' in out
    assert '<｜DSML｜parameter name="ok" string="false">true</｜DSML｜parameter>' in out
    assert '<｜DSML｜parameter name="s" string="true">q"<</｜DSML｜parameter>' in out
    assert out.endswith(f"</｜DSML｜tool_calls>{EOS}")


def test_response_format_follows_the_system_text() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    out = enc(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        thinking=False,
        response_format=fmt,
    )
    want = (
        f"{BOS}S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to"
        f" reply:\n{json.dumps(fmt, ensure_ascii=False)}{U}Q{A}</think>"
    )
    assert out == want


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "developer", "content": ""}], "developer message needs content"),
        ([{"role": "latest_reminder", "content": "x"}], "'latest_reminder' is not supported"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            "messages[0].tool_calls[0].function.arguments is not JSON",
        ),
        ([{"role": "user", "content": 3}], "messages[0]: content must be"),
    ],
)
def test_what_cannot_be_rendered_is_a_typed_error(
    messages: list[dict[str, Any]], words: str
) -> None:
    with pytest.raises(ChatFormatError, match=words.replace("[", r"\[").replace("]", r"\]")):
        enc(messages)
