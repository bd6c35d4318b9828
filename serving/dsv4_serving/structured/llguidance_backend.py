"""``GrammarBackend`` on llguidance (docs/agent-api.md, "Structured outputs (core)": why this library)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import llguidance as llg

from dsv4_serving.chat import dsml
from dsv4_serving.chat.tool_grammar import ToolGrammarError, lit, render_lark, tool_calls_lark
from dsv4_serving.structured.backend import Bitmask
from dsv4_serving.structured.spec import GrammarKind, GrammarSpec, GrammarSpecError

# Free whitespace is bounded per gap: a model can pretty-print (a newline and indentation), but
# cannot emit whitespace forever inside a value.
WHITESPACE = r"[ \t\n\r]{0,32}"


class SerializedTokenizer(Protocol):
    """A HuggingFace ``tokenizers.Tokenizer`` (what llguidance reads is its JSON)."""

    def to_str(self) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


# reasoning text: anything without a spelled-out close tag (the close is the special token)
_REASONING = r"/(?s:.*)/ & ~/(?s:.*<\/think>.*)/"


class LLGuidanceBackend:
    """Compiles specs against one tokenizer; masks are ``vocab_size`` wide."""

    def __init__(
        self, tokenizer: SerializedTokenizer, eos_token_ids: Sequence[int], vocab_size: int
    ) -> None:
        if not eos_token_ids:
            raise ValueError("llguidance needs at least one EOS token id")
        self.vocab_size = vocab_size
        # n_vocab = the logits' width: ids past the tokenizer have no bytes, so never allowed
        self._tokenizer = llg.LLTokenizer(
            tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        close = tokenizer.token_to_id(dsml.THINK_CLOSE)
        # the think block's close: its special token when the tokenizer has one
        self._think_close = lit(dsml.THINK_CLOSE) if close is None else f"<[{close}]>"

    def check(self, spec: GrammarSpec) -> None:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            self._grammar(spec), self._tokenizer
        )
        if is_error:
            raise GrammarSpecError(spec.field, _one_line(messages[0]))

    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        matcher = llg.LLMatcher(self._tokenizer, self._grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarSpecError(spec.field, _one_line(matcher.get_error().split("<state>")[0]))
        return LLGuidanceGrammar(matcher, tuple(matcher.get_grammar_warnings()))

    def _grammar(self, spec: GrammarSpec) -> str:
        options: Any = {
            "whitespace_flexible": True,
            "whitespace_pattern": WHITESPACE,
            # strict: a keyword llguidance cannot enforce is an error; else it is dropped (a warning)
            "lenient": not spec.strict,
        }
        kind = spec.kind
        if kind in (GrammarKind.REGEX, GrammarKind.LARK) and spec.reasoning:
            raise GrammarSpecError(
                spec.field,
                "a regex or Lark grammar needs thinking off (it would constrain reasoning)",
            )
        if kind is GrammarKind.REGEX:
            return llg.LLMatcher.grammar_from_regex(spec.grammar)
        if kind is GrammarKind.LARK:
            return llg.LLMatcher.grammar_from_lark(spec.grammar)
        if kind in (GrammarKind.JSON_OBJECT, GrammarKind.JSON_SCHEMA) and not spec.reasoning:
            try:
                return llg.LLMatcher.grammar_from_json_schema(spec.schema, overrides=options)
            except ValueError as exc:
                raise GrammarSpecError(spec.field, _one_line(str(exc))) from exc
        rules, start = self._rules(spec, options)
        if spec.reasoning:
            rules["REASONING"] = _REASONING
            start = f"REASONING {self._think_close} {start}"
        return llg.LLMatcher.grammar_from_lark(render_lark(rules, start))

    def _rules(self, spec: GrammarSpec, options: Any) -> tuple[dict[str, str], str]:
        """Lark rules and the start expression of a grammar that may follow reasoning."""
        if spec.kind is GrammarKind.TOOL_CALLS:
            tools = [(t.name, json.loads(t.parameters)) for t in spec.tools]
            try:
                return tool_calls_lark(tools, spec.parallel, spec.block, options), "calls"
            except ToolGrammarError as exc:
                raise GrammarSpecError(exc.field, exc.problem) from exc
        if spec.kind is GrammarKind.CHOICE:
            return {"body": " | ".join(lit(c) for c in json.loads(spec.grammar))}, "body"
        schema = json.loads(spec.schema)
        if schema is False:
            raise GrammarSpecError(spec.field, "the schema false matches nothing")
        schema = {} if schema is True else dict(schema)
        schema["x-guidance"] = options
        return {"body": "%json " + json.dumps(schema, ensure_ascii=False)}, "body"


@dataclass(frozen=True)
class LLGuidanceGrammar:
    """A compiled grammar: a matcher at the start, copied for each request."""

    prototype: llg.LLMatcher
    warnings: tuple[str, ...]  # keywords dropped (non-strict schemas)

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.prototype.deep_copy())


class LLGuidanceMatcher:
    def __init__(self, matcher: llg.LLMatcher) -> None:
        self._m = matcher

    def fill_bitmask(self, row: Bitmask) -> None:
        if row.dtype.itemsize != 4 or row.ndim != 1 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError("a mask row is one C-contiguous row of 32-bit words")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def validate(self, tokens: list[int]) -> int:
        return self._m.validate_tokens(tokens)

    def is_terminated(self) -> bool:
        return self._m.is_stopped() and not self._m.is_error()

    def rollback(self, num_tokens: int) -> None:
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.error()}")

    def error(self) -> str:
        """Why the matcher refused a token ("" when it did not)."""
        # the first line; the rest is llguidance's state dump
        return self._m.get_error().split("\n", 1)[0]


def _one_line(message: str) -> str:
    return " ".join(message.split())
