"""A chat request as sent (its JSON body) -> the prompt text of DeepSeek's format, and the format
a model gets: the one rendering the engine's API server and the gateway both use, so that the
gateway's prefix hashes are taken over the very ids the engine computes.

Pure: no tokenizer, no pydantic model; the body's fields are read as the API declares them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_serving.chat.effort import read_effort_table
from dsv4_serving.chat.messages import EncodeOptions
from dsv4_serving.chat.registry import JINJA, ChatFormat, chat_format_for, chat_format_named
from dsv4_serving.chat.switches import ChatSwitchError, ChatSwitches, resolve_switches

log = logging.getLogger(__name__)

TEMPLATE_KWARGS = ("thinking", "enable_thinking", "drop_thinking")
"""The ``chat_template_kwargs`` DeepSeek's format reads; any other key is a 400."""
RENDERED_FIELDS = (
    "thinking",
    "chat_template_kwargs",
    "reasoning_effort",
    "tools",
    "response_format",
)
"""The body's fields, besides ``messages``, that a DeepSeek-format prompt depends on."""
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")
"""The message fields the encoders read (others, e.g. DeepSeek's per-message ``tools``, are not
API fields: the engine drops them, and so must anything that renders the same prompt)."""


@dataclass(frozen=True, slots=True)
class RenderedChat:
    text: str
    switches: ChatSwitches
    tools: list[dict[str, Any]]


def render_chat(
    fmt: ChatFormat,
    messages: Sequence[Mapping[str, Any]],
    body: Mapping[str, Any],
    default_thinking: bool,
) -> RenderedChat:
    """The prompt of a DeepSeek-format chat: ``messages`` and the ``RENDERED_FIELDS`` of a body.

    Raises ``ChatSwitchError`` (a switch, naming its field) or ``ChatFormatError`` (a message).
    """
    if fmt.encode is None:
        raise ValueError("the jinja format is rendered by the tokenizer's chat_template")
    kwargs = body.get("chat_template_kwargs") or {}
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise ChatSwitchError(
            "chat_template_kwargs",
            f"unknown keys {unknown} (DeepSeek's format reads {', '.join(TEMPLATE_KWARGS)})",
        )
    drop = kwargs.get("drop_thinking", True)
    if not isinstance(drop, bool):
        raise ChatSwitchError(
            "chat_template_kwargs.drop_thinking", f"must be a boolean, not {drop!r}"
        )
    switches = resolve_switches(
        thinking=body.get("thinking"),
        chat_template_kwargs=kwargs or None,
        reasoning_effort=body.get("reasoning_effort"),
        default_thinking=default_thinking,
    )
    tools = list(body.get("tools") or [])
    rf = body.get("response_format")
    opts = EncodeOptions(
        thinking=switches.thinking,
        effort=switches.effort,
        tools=tools,
        # DeepSeek's format shows the model the schema it must follow (the grammar holds it)
        response_format=rf if rf and rf.get("type") == "json_schema" else None,
        drop_thinking=drop,
    )
    msgs = [{k: m[k] for k in MESSAGE_FIELDS if m.get(k) is not None} for m in messages]
    return RenderedChat(fmt.encode(msgs, opts), switches, tools)


def model_config(model: str) -> dict[str, Any] | None:
    """A preset's config, or the ``config.json`` beside a checkpoint (a directory or a file in
    it); None when there is none."""
    from dsv4_serving.presets.configs import PRESETS, preset_config

    if model in PRESETS:
        return preset_config(model)
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path.parent / "config.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


def chat_format_of(model: str, name: str = "auto") -> ChatFormat:
    """The format a model's chat requests get: ``name`` (``--chat-format``), or by the model's
    config.json; a checkpoint's own reasoning-effort table when it ships one."""
    if name != "auto":
        fmt = chat_format_named(name)
    else:
        config = model_config(model)
        fmt = chat_format_for(config) if config is not None else JINJA
    path = Path(model)
    root = path if path.is_dir() else path.parent if path.is_file() else None
    encoder = root / "encoding" / "encoding_dsv4.py" if root is not None else None
    if encoder is not None and encoder.is_file():
        table = read_effort_table(encoder.read_text())
        if table is not None:
            fmt = fmt.with_effort_table(table)
    log.info("chat format: %s", fmt.name)
    return fmt
