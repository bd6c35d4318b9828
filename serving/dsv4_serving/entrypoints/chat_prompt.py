"""A chat request's prompt: DeepSeek's encoder (``chat/``) for models in its format, the
tokenizer's Jinja ``chat_template`` for the others; with what the output parser of each choice
needs to know (the mode, the tools, ``tool_choice``, ``parallel_tool_calls``).

Rendering is a pure function of the body: a PD decode renders the same ids as its prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4_serving.chat.registry import ChatFormat
from dsv4_serving.chat.request import RENDERED_FIELDS, render_chat
from dsv4_serving.chat.request import chat_format_of as chat_format_of  # the engine's import
from dsv4_serving.chat.switches import ChatSwitchError
from dsv4_serving.engine.engine.tokenizer import Tokenizer
from dsv4_serving.entrypoints.chat_output import OutputSpec
from dsv4_serving.entrypoints.checks import BadRequest
from dsv4_serving.entrypoints.protocol import ChatCompletionRequest


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """The prompt text and how each choice's output is parsed (None for Jinja: the output is
    content, as the model wrote it)."""

    text: str
    output: OutputSpec | None = None


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
        names = _tool_names(list(body.tools or []))
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        fields = {k: getattr(body, k) for k in RENDERED_FIELDS}
        rendered = render_chat(self.format, messages, fields, self.default_thinking)
        switches, text, tools = rendered.switches, rendered.text, rendered.tools
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
