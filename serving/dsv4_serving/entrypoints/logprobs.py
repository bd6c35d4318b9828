"""One choice's logprobs in the OpenAI formats: completions (``tokens``, ``token_logprobs``,
``top_logprobs`` dicts, ``text_offset``) and chat (``content`` entries with ``bytes``).

A completions ``top_logprobs`` entry is a dict keyed by token text, so the spelling of a token
must be unique within it: a token is its decoded text, unless that text is not the token's own
(part of a UTF-8 character, which decodes to U+FFFD, as many byte tokens do) or is already a
key of the same dict; then it is ``token_id:<id>``, vLLM's spelling, which
``return_tokens_as_token_ids`` asks for everywhere. The sampled token is always in its step's
dict (first), then the most likely alternatives, as the OpenAI API defines it (``logprobs`` + 1
entries at most). ``-inf`` becomes -9999.0 (JSON has no infinity; vLLM's convention).
"""

from __future__ import annotations

from typing import Any

from dsv4_serving.engine.engine.tokenizer import Tokenizer
from dsv4_serving.engine.request import Logprob

FLOOR = -9999.0
_PARTIAL = "\ufffd"


def _value(v: float) -> float:
    return max(v, FLOOR)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChoiceLogprobs:
    """Renders one choice's logprobs, increment by increment (a stream's chunks or a whole
    answer); ``text_offset`` counts characters of the choice's text from its start."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, as_token_ids: bool = False) -> None:
        self.tok, self.chat, self.as_token_ids = tokenizer, chat, as_token_ids
        self.ids: list[int] = []  # the choice's tokens so far
        # the decode window (``_offsets``): its context's first token, its first token, the
        # characters before its first token and those of its context
        self._ctx = self._base = self._chars = self._ctx_chars = 0
        self._tail = ""  # the window's text after its context (the last token's ``after``)

    def _text(self, i: int) -> str | None:
        """The token's own text, or None when it has none (part of a character)."""
        text = self.tok.decode([i], skip_special_tokens=False)
        return None if _PARTIAL in text else text

    def spell(self, i: int) -> str:
        text = None if self.as_token_ids else self._text(i)
        return f"token_id:{i}" if text is None else text

    def _offsets(self, new: list[int]) -> list[int]:
        """Where each of ``new`` (tokens after ``ids``) starts in the choice's text: the index
        of the character holding its first byte. Each token's offset depends on the tokens up
        to it only, so it is the same however a stream's tokens are grouped into increments
        (coalesced steps, a continued stream). A trailing U+FFFD is either a character still
        being written (a token that adds no character continues it) or settled (bytes that are
        no UTF-8: the next token starts a new character); the text before and after the token
        tells which. Decoding is windowed as ``IncrementalDetokenizer`` does, from the last
        place the text ended on a whole character, so a long answer costs no more per token."""
        out = []
        for i in new:
            self.ids.append(i)
            k = len(self.ids)
            before = self._tail
            after = self.tok.decode(self.ids[self._ctx : k])[self._ctx_chars :]
            offset = _common_prefix(before, after)
            if after == before and before.endswith(_PARTIAL) and self.tok.decode([i]):
                offset -= 1  # it continues the character being written
            out.append(self._chars + offset)
            if after and not after.endswith(_PARTIAL):  # a whole character: a new window
                self._chars += len(after)
                self._ctx, self._base = self._base, k
                self._ctx_chars = len(self.tok.decode(self.ids[self._ctx : self._base]))
                after = ""
            self._tail = after
        return out

    def prime(self, ids: list[int]) -> None:
        """The tokens the client already has (a continued stream), rendering nothing."""
        self._offsets(ids)

    def _top(self, lp: Logprob) -> dict[str, float]:
        out: dict[str, float] = {}
        for tid, v in [(lp.token_id, lp.logprob), *lp.top]:
            if tid == lp.token_id and out:
                continue  # the sampled token is in already
            key = self.spell(tid)
            if key in out:  # another token with the same text
                key = f"token_id:{tid}"
            out[key] = _value(v)
        return out

    def _chat_entry(self, i: int, v: float) -> dict[str, Any]:
        text = None if self.as_token_ids else self._text(i)
        return {
            "token": self.spell(i),
            "logprob": _value(v),
            "bytes": list(text.encode()) if text is not None else None,
        }

    def render(self, lps: list[Logprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        **self._chat_entry(lp.token_id, lp.logprob),
                        "top_logprobs": [self._chat_entry(t, v) for t, v in lp.top],
                    }
                    for lp in lps
                ]
            }
        offsets = self._offsets([lp.token_id for lp in lps])
        return {
            "tokens": [self.spell(lp.token_id) for lp in lps],
            "token_logprobs": [_value(lp.logprob) for lp in lps],
            "top_logprobs": [self._top(lp) for lp in lps],
            "text_offset": offsets,
        }
