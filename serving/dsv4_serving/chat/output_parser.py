"""One streaming parser of a DeepSeek completion: reasoning, content and DSML tool calls.

``feed`` takes text deltas (decoded *with* special tokens) and returns events; ``finish`` ends the
completion. What comes out does not depend on how the text was cut: a marker that may still be
forming at the end of a delta (``</th``, ``\\n\\n<｜DS``) is held back until it is decided, and a
call is emitted only once its ``invoke`` is complete and well formed. A non-streamed parse is
one ``feed`` of the whole text (``parse``). Rules and the variants accepted: docs/agent-api.md.
"""

# DeepSeek's markers are spelled with U+FF5C, not an ASCII bar
# ruff: noqa: RUF002

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum

from dsv4_serving.chat import dsml
from dsv4_serving.chat.tool_ids import random_tool_call_id


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class ToolStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolArgs:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolEnd:
    index: int


Event = Reasoning | Content | ToolStart | ToolArgs | ToolEnd


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI's ``function.arguments``


@dataclass(slots=True)
class ParsedMessage:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class _State(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    BLOCK = "block"  # inside a block of calls
    RAW = "raw"  # after a malformed call: the rest is content, verbatim
    DONE = "done"


class _NeedMore:
    """The text so far cannot decide the element yet."""


_NEED_MORE = _NeedMore()
_MALFORMED = None
_INVOKE_HEAD = re.compile(re.escape(dsml.INVOKE_OPEN) + r' name="([^"]*)">')
_PARAM_HEAD = re.compile(re.escape(dsml.PARAM_OPEN) + r' name="([^"]*)" string="(true|false)">')

_Params = list[tuple[str, str, bool]]
_Invoke = tuple[str, _Params, int]  # name, params, end offset


def _parse_invoke(text: str, pos: int, names: Collection[str] | None) -> _Invoke | _NeedMore | None:
    """One ``invoke`` at ``pos`` (which starts with its open tag)."""
    head = _INVOKE_HEAD.match(text, pos)
    if head is None:
        return _NEED_MORE if ">" not in text[pos:] else _MALFORMED
    name = head.group(1)
    if names is not None and name not in names:
        return _MALFORMED
    params: _Params = []
    pos = head.end()
    while True:
        pos = _skip_space(text, pos)
        rest = text[pos:]
        if rest.startswith(dsml.INVOKE_CLOSE):
            return name, params, pos + len(dsml.INVOKE_CLOSE)
        if rest.startswith(dsml.PARAM_OPEN):
            got = _parse_param(text, pos, {p[0] for p in params})
            if not isinstance(got, tuple):
                return got
            params.append(got[0])
            pos = got[1]
        elif not _could_start(rest, (dsml.INVOKE_CLOSE, dsml.PARAM_OPEN)):
            return _MALFORMED
        else:
            return _NEED_MORE


def _parse_param(
    text: str, pos: int, seen: set[str]
) -> tuple[tuple[str, str, bool], int] | _NeedMore | None:
    head = _PARAM_HEAD.match(text, pos)
    if head is None:
        return _NEED_MORE if ">" not in text[pos:] else _MALFORMED
    name = head.group(1)
    if name in seen:
        return _MALFORMED
    end = text.find(dsml.PARAM_CLOSE, head.end())
    if end < 0:
        return _NEED_MORE
    value = text[head.end() : end]
    return (name, value, head.group(2) == "true"), end + len(dsml.PARAM_CLOSE)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _could_start(rest: str, markers: tuple[str, ...]) -> bool:
    """``rest`` is empty or a proper prefix of a marker: more text may complete it."""
    return any(m.startswith(rest) for m in markers)


def _held_back(buf: str, markers: tuple[str, ...]) -> int:
    """How much of ``buf``'s end to keep: a partial marker, and up to two newlines before it
    (the ``\\n\\n`` that precedes a block of calls is a delimiter, not text)."""
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), hold, -1):
            if buf.endswith(m[:k]):
                hold = k
                break
    end = len(buf) - hold
    newlines = 0
    while newlines < 2 and end - newlines > 0 and buf[end - newlines - 1] == "\n":
        newlines += 1
    return hold + newlines


def _strip_delimiter(text: str) -> tuple[str, str]:
    """(text, delimiter): the ``\\n\\n`` (or lone ``\\n``) before a block is not content."""
    for d in ("\n\n", "\n"):
        if text.endswith(d):
            return text[: -len(d)], d
    return text, ""


class OutputParser:
    """Parses one choice's completion.

    ``thinking``: the prompt opened the think block, so the text starts as reasoning. ``block``:
    the call block's name (``tool_calls`` for V4, ``function_calls`` for V3.2). ``tool_names``:
    when given, a call to another name is malformed. ``new_id(index)`` names each call once.
    ``calls``: False parses reasoning only, a call block stays content (``tool_choice: none``).
    """

    def __init__(
        self,
        *,
        thinking: bool,
        block: str = dsml.V4_BLOCK,
        tool_names: Collection[str] | None = None,
        new_id: Callable[[int], str] = random_tool_call_id,
        calls: bool = True,
    ) -> None:
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._open = dsml.block_open(block)
        opens = (self._open,) if calls else ()
        self._reasoning_ends = (dsml.THINK_CLOSE, *opens, dsml.EOS)
        self._content_ends = (*opens, dsml.EOS)
        self._close = dsml.block_close(block)
        self._names = None if tool_names is None else frozenset(tool_names)
        self._new_id = new_id
        self._buf = ""
        self._pos = 0  # in BLOCK: where the next element of the block starts in _buf
        self._delimiter = ""  # in BLOCK: the newlines stripped before it
        self._block_calls = 0
        self.result = ParsedMessage()

    def feed(self, delta: str) -> list[Event]:
        if self._state is _State.DONE:
            return []
        self._buf += delta
        events: list[Event] = []
        while self._step(events):
            pass
        return self._record(events)

    def finish(self, reason: str | None = "stop") -> list[Event]:
        """End of the completion. ``length`` (truncated): an unfinished call is dropped, the calls
        before it are kept. Any other reason: an unfinished call is malformed, so it is content."""
        events: list[Event] = []
        if self._state is _State.REASONING:
            self._emit(events, Reasoning, self._buf)
        elif self._state in (_State.CONTENT, _State.RAW):
            self._emit(events, Content, self._buf)
        elif self._state is _State.BLOCK and reason != "length":
            self._malformed(events)
            self._emit(events, Content, self._buf)
        self._buf, self._state = "", _State.DONE
        return self._record(events)

    # ---- one step of the state machine: True when it made progress ----------------------------

    def _step(self, events: list[Event]) -> bool:
        if self._state is _State.REASONING:
            return self._text_step(events, Reasoning, self._reasoning_ends)
        if self._state is _State.CONTENT:
            return self._text_step(events, Content, self._content_ends)
        if self._state is _State.RAW:
            return self._text_step(events, Content, (dsml.EOS,))
        if self._state is _State.BLOCK:
            return self._block_step(events)
        return False

    def _text_step(
        self, events: list[Event], kind: type[Reasoning | Content], markers: tuple[str, ...]
    ) -> bool:
        found = [(self._buf.find(m), m) for m in markers]
        hits = [(p, m) for p, m in found if p >= 0]
        if not hits:
            keep = _held_back(self._buf, markers)
            self._emit(events, kind, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        pos, marker = min(hits)
        before, after = self._buf[:pos], self._buf[pos:]
        if marker == self._open:
            before, self._delimiter = _strip_delimiter(before)
            self._emit(events, kind, before)
            self._buf, self._pos, self._block_calls = after, len(self._open), 0
            self._state = _State.BLOCK
            return True
        self._emit(events, kind, before)
        self._buf = after[len(marker) :]
        self._state = _State.CONTENT if marker == dsml.THINK_CLOSE else _State.DONE
        return self._state is not _State.DONE

    def _block_step(self, events: list[Event]) -> bool:
        eos = self._buf.find(dsml.EOS)
        text = self._buf if eos < 0 else self._buf[:eos]
        pos = _skip_space(text, self._pos)
        rest = text[pos:]
        if rest.startswith(self._close):
            self._buf = self._buf[pos + len(self._close) :]
            self._state = _State.CONTENT
            return True
        got: _Invoke | _NeedMore | None
        if rest.startswith(dsml.INVOKE_OPEN):
            got = _parse_invoke(text, pos, self._names)
        else:
            got = _NEED_MORE if _could_start(rest, (self._close, dsml.INVOKE_OPEN)) else None
        if isinstance(got, tuple):
            self._emit_call(events, got)
            self._pos = got[2]
            return True
        if isinstance(got, _NeedMore) and eos < 0:
            return False
        # malformed, or cut short by the end of the sentence
        self._malformed(events)
        self._state = _State.RAW
        return True

    def _malformed(self, events: list[Event]) -> None:
        """The block from its first unparsed element on becomes content (the whole block, with
        its delimiter, when no call of it was emitted); whitespace alone is dropped."""
        if self._block_calls == 0:
            self._buf = self._delimiter + self._buf
        else:
            self._buf = self._buf[_skip_space(self._buf, self._pos) :]

    def _emit_call(self, events: list[Event], invoke: _Invoke) -> None:
        name, params, _ = invoke
        index = len(self.result.tool_calls) + sum(isinstance(e, ToolStart) for e in events)
        events.append(ToolStart(index, self._new_id(index), name))
        events.append(ToolArgs(index, dsml.arguments_json(params)))
        events.append(ToolEnd(index))
        self._block_calls += 1

    @staticmethod
    def _emit(events: list[Event], kind: type[Reasoning | Content], text: str) -> None:
        if text:
            events.append(kind(text))

    def _record(self, events: list[Event]) -> list[Event]:
        calls = self.result.tool_calls
        for e in events:
            if isinstance(e, Reasoning):
                self.result.reasoning += e.text
            elif isinstance(e, Content):
                self.result.content += e.text
            elif isinstance(e, ToolStart):
                calls.append(ToolCall(e.id, e.name, ""))
            elif isinstance(e, ToolArgs):
                calls[e.index] = ToolCall(
                    calls[e.index].id, calls[e.index].name, calls[e.index].arguments + e.text
                )
        return events


def parse(
    text: str,
    *,
    thinking: bool,
    finish_reason: str | None = "stop",
    block: str = dsml.V4_BLOCK,
    tool_names: Collection[str] | None = None,
    new_id: Callable[[int], str] = random_tool_call_id,
) -> ParsedMessage:
    """The non-streamed parse: the whole text in one delta."""
    parser = OutputParser(thinking=thinking, block=block, tool_names=tool_names, new_id=new_id)
    parser.feed(text)
    parser.finish(finish_reason)
    return parser.result
