"""A chat request's prompt: DeepSeek's encoder (``chat/``) for models in its format, the
tokenizer's Jinja ``chat_template`` for the others; with what the output parser of each choice
needs to know (the mode, the tools, ``tool_choice``, ``parallel_tool_calls``).

Rendering is a pure function of the body: a PD decode renders the same ids as its prefill."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_serving.chat.effort import read_effort_table
from dsv4_serving.chat.messages import EncodeOptions
from dsv4_serving.chat.registry import (
    JINJA,
    ChatFormat,
    chat_format_for,
    chat_format_named,
)
from dsv4_serving.chat.switches import ChatSwitchError, resolve_switches
from dsv4_serving.engine.engine.tokenizer import Tokenizer
from dsv4_serving.entrypoints.chat_output import OutputSpec
from dsv4_serving.entrypoints.checks import BadRequest
from dsv4_serving.entrypoints.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)

TEMPLATE_KWARGS = ("thinking", "enable_thinking", "drop_thinking")
"""The ``chat_template_kwargs`` DeepSeek's format reads; any other key is a 400."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """The prompt text and how each choice's output is parsed (None for Jinja: the output is
    content, as the model wrote it)."""

    text: str
    output: OutputSpec | None = None


def _model_config(model: str) -> dict[str, Any] | None:
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
        config = _model_config(model)
        fmt = chat_format_for(config) if config is not None else JINJA
    encoder = Path(model) / "encoding" / "encoding_dsv4.py"
    if encoder.is_file():
        table = read_effort_table(encoder.read_text())
        if table is not None:
            fmt = fmt.with_effort_table(table)
    log.info("chat format: %s", fmt.name)
    return fmt


class ChatRenderer:
    """Renders one model's chat requests."""

    def __init__(self, fmt: ChatFormat, tokenizer: Tokenizer, default_thinking: bool) -> None:
        self.format = fmt
        self.tokenizer = tokenizer
        self.default_thinking = default_thinking

    def render(self, body: ChatCompletionRequest) -> ChatPrompt:
        try:
            if self.format.is_jinja:
                return self._jinja(body)
            return self._deepseek(body)
        except BadRequest:
            raise
        except ChatSwitchError as exc:
            raise BadRequest(str(exc), param=exc.field) from exc
        except ValueError as exc:  # ChatFormatError, the template's, a content part's
            raise BadRequest(str(exc), param="messages") from exc

    def _jinja(self, body: ChatCompletionRequest) -> ChatPrompt:
        deepseek_only = ("tools", "thinking", "reasoning_effort", "chat_template_kwargs")
        for name in deepseek_only:
            if getattr(body, name):
                raise BadRequest(
                    f"{name} is supported for models in DeepSeek's chat format only; this "
                    "model's chat format is its Jinja chat_template",
                    param=name,
                    code="unsupported_parameter",
                )
        for i, m in enumerate(body.messages):
            if m.tool_calls:
                raise BadRequest(
                    "assistant tool_calls are supported for models in DeepSeek's chat format only",
                    param=f"messages[{i}].tool_calls",
                    code="unsupported_parameter",
                )
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        return ChatPrompt(self.tokenizer.apply_chat_template(msgs))

    def _deepseek(self, body: ChatCompletionRequest) -> ChatPrompt:
        kwargs = body.chat_template_kwargs or {}
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
            thinking=body.thinking,
            chat_template_kwargs=kwargs or None,
            reasoning_effort=body.reasoning_effort,
            default_thinking=self.default_thinking,
        )
        tools = list(body.tools or [])
        names = _tool_names(tools)
        rf = body.response_format
        opts = EncodeOptions(
            thinking=switches.thinking,
            effort=switches.effort,
            tools=tools,
            # DeepSeek's format shows the model the schema it must follow (the grammar holds it)
            response_format=rf if rf and rf.get("type") == "json_schema" else None,
            drop_thinking=drop,
        )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        assert self.format.encode is not None
        text = self.format.encode(messages, opts)
        spec = OutputSpec(
            self.format,
            thinking=switches.thinking,
            tool_names=frozenset(names),
            calls=bool(tools) and body.tool_choice != "none",
            parallel=body.parallel_tool_calls is not False,
        )
        return ChatPrompt(text, spec)


def _tool_names(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"tools[{i}].function.name is missing", param="tools")
        names.append(fn["name"])
    return names
