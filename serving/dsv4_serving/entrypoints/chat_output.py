"""One chat choice's completion as OpenAI's parts: ``reasoning_content``, ``content`` and
``tool_calls`` (``chat/output_parser``), as stream deltas and as the final message.

The parser reads the text decoded with special tokens (``SamplingParams.skip_special_tokens``
False), so ``</think>`` and EOS reach it. Streamed and non-streamed answers are the same parse:
the parser's result does not depend on how the text is cut. Models in a Jinja format get their
text as content, unparsed."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dsv4_serving.chat import deltas
from dsv4_serving.chat.output_parser import Event, OutputParser, ToolArgs, ToolEnd, ToolStart
from dsv4_serving.chat.registry import ChatFormat
from dsv4_serving.chat.tool_ids import derived_tool_call_id


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How a request's choices are parsed (from its rendered prompt)."""

    format: ChatFormat
    thinking: bool  # the prompt opened the think block: the output starts as reasoning
    tool_names: frozenset[str] = frozenset()
    calls: bool = False  # extract tool calls (tools given and tool_choice is not none)
    parallel: bool = True  # False (parallel_tool_calls): only the first call is kept


class ChoiceOutput:
    """A choice's parts. ``spec`` None: the text is content as it comes (a Jinja model)."""

    def __init__(self, spec: OutputSpec | None, request_id: str, choice: int) -> None:
        self.spec = spec
        self.text = ""
        self._parser: OutputParser | None = None
        if spec is not None:
            self._parser = spec.format.parser(
                thinking=spec.thinking,
                tool_names=spec.tool_names,
                new_id=functools.partial(derived_tool_call_id, request_id, choice),
                calls=spec.calls,
            )

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas of the next piece of text (none while the parser holds it back)."""
        if self._parser is None:
            self.text += text
            return [deltas.content_delta(text)]
        return self._deltas(self._parser.feed(text))

    def finish(self, engine_reason: str | None) -> list[dict[str, Any]]:
        if self._parser is None:
            return []
        return self._deltas(self._parser.finish(engine_reason))

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        out = []
        for e in events:
            if self._dropped(e):
                continue
            d = deltas.event_delta(e)
            if d is not None:
                out.append(d)
        return out

    def _dropped(self, e: Event) -> bool:
        """``parallel_tool_calls: false``: every call after the first is dropped."""
        assert self.spec is not None
        return (
            not self.spec.parallel and isinstance(e, ToolStart | ToolArgs | ToolEnd) and e.index > 0
        )

    def message(self) -> dict[str, Any]:
        """The non-streamed ``message`` (after ``finish``)."""
        if self._parser is None:
            return {"role": "assistant", "content": self.text}
        out = deltas.message(self._parser.result)
        if "tool_calls" in out and not self._keeps_all():
            out["tool_calls"] = out["tool_calls"][:1]
        return out

    def _keeps_all(self) -> bool:
        return self.spec is None or self.spec.parallel

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when the model stopped after calling tools."""
        if self._parser is None:
            return engine_reason
        return deltas.finish_reason(self._parser.result, engine_reason)

    def reasoning_tokens(
        self, token_ids: Sequence[int], think_end_id: int | None, encode: Callable[[str], list[int]]
    ) -> int:
        """The tokens of the reasoning: those before ``</think>`` when it is one token and in
        the output, all of them when the output is reasoning only, else the reasoning text's."""
        if self._parser is None or self.spec is None or not self.spec.thinking:
            return 0
        if think_end_id is not None and think_end_id in token_ids:
            return list(token_ids).index(think_end_id)
        parsed = self._parser.result
        if not parsed.content and not parsed.tool_calls:
            return len(token_ids)
        return len(encode(parsed.reasoning)) if parsed.reasoning else 0
