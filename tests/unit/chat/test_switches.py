"""Request switches -> (thinking, effort tier), with the documented precedence and typed errors."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_serving.chat.switches import ChatSwitchError, ChatSwitches, resolve_switches

ON, OFF = {"type": "enabled"}, {"type": "disabled"}


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, ChatSwitches(True, None)),
        ({"default_thinking": False}, ChatSwitches(False, None)),
        ({"thinking": OFF}, ChatSwitches(False, None)),
        ({"chat_template_kwargs": {"thinking": False}}, ChatSwitches(False, None)),
        (
            {"chat_template_kwargs": {"enable_thinking": True}, "default_thinking": False},
            ChatSwitches(True, None),
        ),
        ({"reasoning_effort": "none"}, ChatSwitches(False, None)),
        ({"reasoning_effort": "minimal"}, ChatSwitches(True, "low")),
        ({"reasoning_effort": "low"}, ChatSwitches(True, "low")),
        ({"reasoning_effort": "medium"}, ChatSwitches(True, "high")),
        ({"reasoning_effort": "high"}, ChatSwitches(True, "high")),
        ({"reasoning_effort": "xhigh"}, ChatSwitches(True, "high")),
        ({"reasoning_effort": "max"}, ChatSwitches(True, "max")),
        # precedence: thinking > chat_template_kwargs > reasoning_effort "none" > default
        ({"thinking": ON, "chat_template_kwargs": {"thinking": False}}, ChatSwitches(True, None)),
        ({"thinking": OFF, "reasoning_effort": "max"}, ChatSwitches(False, None)),
        (
            {"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "none"},
            ChatSwitches(True, None),
        ),
        ({"chat_template_kwargs": {}, "reasoning_effort": "high"}, ChatSwitches(True, "high")),
    ],
)
def test_mapping(fields: dict[str, Any], want: ChatSwitches) -> None:
    assert resolve_switches(**fields) == want


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"thinking": True}, "thinking"),
        ({"thinking": {"type": "auto"}}, "thinking"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
        (
            {"chat_template_kwargs": {"thinking": True, "enable_thinking": False}},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"reasoning_effort": "huge"}, "reasoning_effort"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
    ],
)
def test_bad_values_name_their_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ChatSwitchError) as e:
        resolve_switches(**fields)
    assert e.value.field == field and str(e.value).startswith(field + ":")
