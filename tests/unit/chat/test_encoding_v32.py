"""V3.2's format against DeepSeek's official golden pair (test_input.json / test_output.txt)."""

# ruff: noqa: RUF001
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4_serving.chat import encoding_v32
from dsv4_serving.chat.messages import ChatFormatError, EncodeOptions

DATA = Path(__file__).parent / "data"


def test_official_golden_byte_for_byte() -> None:
    case = json.loads((DATA / "v32_golden_input.json").read_text(encoding="utf-8"))
    want = (DATA / "v32_golden_output.txt").read_text(encoding="utf-8")
    got = encoding_v32.encode(case["messages"], EncodeOptions(thinking=True, tools=case["tools"]))
    assert got + "\n" == want  # the file ends with a newline the encoder does not write


def test_chat_mode_and_developer() -> None:
    msgs = [{"role": "developer", "content": "D"}]
    assert encoding_v32.encode(msgs, EncodeOptions(thinking=False)) == (
        "<｜begin▁of▁sentence｜><｜User｜>\n\n# The user's message is: D<｜Assistant｜></think>"
    )


def test_a_result_without_a_call_is_an_error() -> None:
    with pytest.raises(ChatFormatError, match="no matching assistant tool call"):
        encoding_v32.encode([{"role": "tool", "content": "x"}], EncodeOptions())
