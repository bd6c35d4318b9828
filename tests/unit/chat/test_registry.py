"""Chat formats by checkpoint, the effort table of a checkpoint, and the OpenAI shapes."""

# ruff: noqa: RUF001
from __future__ import annotations

import pytest

from dsv4_serving.chat import deltas, dsml
from dsv4_serving.chat.effort import V4_0731, V4_PREVIEW, EffortTable, read_effort_table
from dsv4_serving.chat.messages import EncodeOptions
from dsv4_serving.chat.output_parser import (
    Content,
    ParsedMessage,
    Reasoning,
    ToolArgs,
    ToolCall,
    ToolEnd,
    ToolStart,
)
from dsv4_serving.chat.registry import (
    DEEPSEEK_V4,
    DEEPSEEK_V32,
    JINJA,
    UnknownChatFormatError,
    chat_format_for,
    chat_format_named,
)
from dsv4_serving.chat.tool_ids import derived_tool_call_id
from dsv4_serving.presets.configs import PRESETS


def test_formats_follow_the_checkpoint() -> None:
    assert chat_format_for({"model_type": "deepseek_v4"}) is DEEPSEEK_V4
    assert chat_format_for({"model_type": "deepseek_v32"}) is DEEPSEEK_V32
    assert chat_format_for({"architectures": ["DeepseekV32ForCausalLM"]}) is DEEPSEEK_V32
    assert chat_format_for({"model_type": "deepseek_v3"}) is JINJA
    assert chat_format_for({}) is JINJA and JINJA.is_jinja and JINJA.parser(thinking=True) is None


def test_v4_presets_speak_v4() -> None:
    v4 = [name for name, config in PRESETS.items() if config.get("model_type") == "deepseek_v4"]
    assert v4, "no V4 preset"
    for name in v4:
        assert chat_format_for(PRESETS[name]) is DEEPSEEK_V4, name


def test_named_formats() -> None:
    assert chat_format_named("deepseek_v32") is DEEPSEEK_V32
    with pytest.raises(UnknownChatFormatError, match="unknown chat format 'x'"):
        chat_format_named("x")


def test_a_format_encodes_and_parses() -> None:
    assert DEEPSEEK_V4.encode is not None
    prompt = DEEPSEEK_V4.encode([{"role": "user", "content": "Hi"}], EncodeOptions(effort="max"))
    assert "Beyond maximum" in prompt
    preview = DEEPSEEK_V4.with_effort_table(V4_PREVIEW)
    assert preview.encode is not None
    assert "Absolute maximum" in preview.encode(
        [{"role": "user", "content": "Hi"}], EncodeOptions(effort="max")
    )
    assert DEEPSEEK_V32.with_effort_table(V4_PREVIEW) is DEEPSEEK_V32
    parser = DEEPSEEK_V32.parser(thinking=False)
    assert parser is not None
    parser.feed(
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'
    )
    assert [c.name for c in parser.result.tool_calls] == ["f"]


SOURCE_0731 = """
X = 1
REASONING_EFFORT_PROMPTS = {
    "low": "",
    "high": ("Reasoning Effort: A.\\n" "more\\n\\n"),
}
DEFAULT_REASONING_EFFORT = "low"
"""


def test_effort_tables_are_read_from_a_checkpoint_encoder_without_running_it() -> None:
    assert read_effort_table(SOURCE_0731) == EffortTable(
        {"low": "", "high": "Reasoning Effort: A.\nmore\n\n"}, "low"
    )
    assert read_effort_table('REASONING_EFFORT_MAX = ("a" "b")\n') == EffortTable(
        {"max": "ab"}, None
    )
    assert read_effort_table("import os\nos.system('x')\n") is None
    assert V4_0731.prefix(None) == "" and V4_0731.prefix("nope") == ""


def test_deltas_shapes() -> None:
    assert deltas.event_delta(Reasoning("r")) == {"reasoning_content": "r"}
    assert deltas.event_delta(Content("c")) == {"content": "c"}
    assert deltas.event_delta(ToolStart(1, "call_x", "f")) == {
        "tool_calls": [
            {
                "index": 1,
                "id": "call_x",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
    }
    assert deltas.event_delta(ToolArgs(1, '{"a"')) == {
        "tool_calls": [{"index": 1, "function": {"arguments": '{"a"'}}]
    }
    assert deltas.event_delta(ToolEnd(1)) is None


def test_message_and_finish_reason() -> None:
    only_calls = ParsedMessage("", "", [ToolCall("call_1", "f", "{}")])
    assert deltas.message(only_calls) == {
        "role": "assistant",
        "content": None,
        "reasoning_content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert deltas.message(ParsedMessage("r", "", [])) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "r",
    }
    assert deltas.finish_reason(only_calls, "stop") == "tool_calls"
    assert deltas.finish_reason(only_calls, "length") == "length"
    assert deltas.finish_reason(ParsedMessage(), "stop") == "stop"


def test_derived_ids_are_stable_and_distinct() -> None:
    a = derived_tool_call_id("req", 0, 0)
    assert a == derived_tool_call_id("req", 0, 0) and a.startswith("call_") and len(a) == 29
    assert len({a, derived_tool_call_id("req", 1, 0), derived_tool_call_id("req", 0, 1)}) == 3
    assert dsml.block_open("tool_calls") == "<｜DSML｜tool_calls>"
