"""Stream continuation, the engine's half: the internal ``continuation`` field the gateway sends
(``entrypoints/fields.py`` lists it as internal; the gateway refuses it from clients).

``continuation: {}`` on a streamed request with ``n`` = 1 asks for *stream state*: after each
increment the stream carries an SSE comment block ``: dsv4 {...}`` (SSE clients skip comments;
the gateway strips them) with the increment's token ids (``t``), the characters of text sent so
far (``c``), whether the choice finished (``f``) and, on the first, the answer's ``id`` and
``created``. The gateway relays an increment's events only with its state block, so what it
has relayed is always whole increments.

``continuation: {token_ids, chars, id, created}`` continues an answer another engine started:
the tokens are appended to the encoded prompt as output already generated (the front end's
detokenizer, stop strings and chat parser are fed them without emitting anything, a grammar's
matcher is advanced over them in the core), the budget
is what is left of ``max_tokens`` (and ``min_tokens``), a seed moves on by as many positions
(``engine/sample/seeding.py``), usage counts them as completion tokens,
and the chunks keep the answer's ``id`` and ``created`` (tool-call ids derive from the id), with
no second role chunk. Greedy output equals an uninterrupted run's: the core computes prompt +
tokens as one prefill, as it does after a preemption. On a prefill for a remote decode (PD) the
tokens are only appended: the prefill computes the KV of prompt + tokens for the decode.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from dsv4_serving.engine.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.sample.seeding import position_seed
from dsv4_serving.entrypoints.chat_output import ChoiceOutput
from dsv4_serving.entrypoints.checks import BadRequest
from dsv4_serving.entrypoints.logprobs import ChoiceLogprobs

FIELD = "continuation"
STATE_PREFIX = ": dsv4 "
"""An SSE comment line: the start of a stream-state block."""


@dataclass(frozen=True, slots=True)
class Continuation:
    """What the gateway asks of a stream: its state (always) and, when ``token_ids`` is not
    empty, to continue an answer whose client already has those tokens and ``chars``
    characters of their text."""

    token_ids: tuple[int, ...] = ()
    chars: int = 0
    response_id: str | None = None
    created: int | None = None

    @property
    def resumes(self) -> bool:
        return bool(self.token_ids)


def _int(raw: dict[str, Any], key: str, default: int | None) -> int | None:
    v = raw.get(key, default)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise BadRequest(f"{FIELD}.{key} must be a non-negative integer", param=FIELD)
    return v


def parse(raw: dict[str, Any] | None, vocab_size: int) -> Continuation | None:
    """The field as sent (None: absent); a malformed one is a 400 naming it."""
    if raw is None:
        return None
    unknown = sorted(set(raw) - {"token_ids", "chars", "id", "created"})
    if unknown:
        raise BadRequest(f"{FIELD}: unknown keys {unknown}", param=FIELD)
    ids = raw.get("token_ids", [])
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
    ):
        raise BadRequest(
            f"{FIELD}.token_ids must be a list of token ids in [0, {vocab_size})", param=FIELD
        )
    rid = raw.get("id")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"{FIELD}.id must be a string", param=FIELD)
    return Continuation(tuple(ids), _int(raw, "chars", 0) or 0, rid, _int(raw, "created", None))


def check(cont: Continuation, stream: bool, n: int) -> None:
    """Stream state and continuation exist for one streamed choice."""
    if n != 1:
        raise BadRequest(f"{FIELD} needs n = 1", param=FIELD)
    if cont.resumes and not stream:
        raise BadRequest(f"{FIELD} with token_ids needs stream = true", param=FIELD)


def apply(
    raw: dict[str, Any] | None,
    vocab_size: int,
    stream: bool,
    n: int,
    prefill: bool,
    ids: list[int],
    params: SamplingParams,
) -> tuple[list[int], SamplingParams, Continuation | None]:
    """A request's ``continuation`` field applied: (the prompt ids, the sampling params, what
    the answer continues or None). A prefill for a remote decode gets prompt + tokens and
    nothing else: its stream state, if any, is the decode's."""
    cont = parse(raw, vocab_size)
    if cont is None:
        return ids, params, None
    if prefill:
        return [*ids, *cont.token_ids], params, None
    check(cont, stream, n)
    if cont.resumes:
        params = remaining(params, cont)
    return ids, params, cont


def remaining(params: SamplingParams, cont: Continuation) -> SamplingParams:
    """The budget left after the tokens already generated; ``resumed_tokens`` tells the core
    which of the prompt's tokens are output (the penalties count them, a grammar's matcher
    is advanced over them)."""
    done = len(cont.token_ids)
    if done >= params.max_tokens:
        raise BadRequest(
            f"{FIELD}: {done} tokens already generated, max_tokens is {params.max_tokens}",
            param=FIELD,
        )
    seed = None if params.seed is None else position_seed(params.seed, done)
    return dataclasses.replace(
        params,
        max_tokens=params.max_tokens - done,
        min_tokens=max(0, params.min_tokens - done),
        seed=seed,  # the draws go on where the first engine's stopped (sample/seeding.py)
        resumed_tokens=done,
    )


def sent_text(tokenizer: Tokenizer, cont: Continuation, skip_special_tokens: bool) -> str:
    """The text the client already has: the tokens' text as the front end decoded it, cut to
    ``chars`` (the rest was held back, by a stop string's tail or a partial character)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return detok.add(list(cont.token_ids), final=False)[: cont.chars]


def prime(
    cont: Continuation, text: str, out: ChoiceOutput | None, logprobs: ChoiceLogprobs
) -> None:
    """Bring a choice's parser and logprob offsets to where the client is, emitting nothing
    (the parser's result does not depend on how its text is cut)."""
    if out is not None:
        out.feed(text)
    logprobs.prime(list(cont.token_ids))


def resume_args(cont: Continuation | None) -> dict[str, Any]:
    """``AsyncLLM.generate``'s arguments for the output already generated."""
    if cont is None or not cont.resumes:
        return {}
    return {"continued": cont.token_ids, "sent_chars": cont.chars}


class StateWriter:
    """A stream's state blocks: off (``of(None)``: no continuation field), or one block per
    increment with the characters sent so far and, on the first, (id, created)."""

    def __init__(self, on: bool, head: tuple[str, int] | None, chars: int) -> None:
        self.on, self.head, self.chars = on, head, chars

    @classmethod
    def of(cls, cont: Continuation | None, rid: str, created: int) -> StateWriter:
        if cont is None:
            return cls(False, None, 0)
        return cls(True, None if cont.resumes else (rid, created), cont.chars)

    def wrap(self, events: str, token_ids: list[int], text: str, finished: bool) -> str:
        """An increment's ``events`` (``token_ids``, whose text sent is ``text``) followed by
        its state block; the stream's first block, with (id, created), leads."""
        if not self.on:
            return events
        self.chars += len(text)
        tail = state_block(token_ids, self.chars, finished, None)
        if self.head is None:
            return events + tail
        head, self.head = self.head, None
        return state_block([], 0, False, head) + events + tail

    def migrated(self, kv_transfer_params: dict[str, Any] | None) -> str:
        """The stream's last block when a drain moves it: ``m`` holds the export of its KV
        (None: none, the continuing engine recomputes it) and how many tokens' KV that is
        (every token but the last); no ``[DONE]`` follows."""
        kv = kv_transfer_params
        moved = {"kv_transfer_params": kv, "tokens": kv["remote_num_tokens"] if kv else 0}
        state = {"t": [], "c": self.chars, "m": moved}
        return f"{STATE_PREFIX}{json.dumps(state, separators=(',', ':'))}\n\n"


def state_block(
    token_ids: list[int], chars: int, finished: bool, head: tuple[str, int] | None
) -> str:
    """One increment's stream-state comment block. ``head``: (id, created), on the first."""
    state: dict[str, Any] = {"t": token_ids, "c": chars}
    if finished:
        state["f"] = 1
    if head is not None:
        state["id"], state["created"] = head
    return f"{STATE_PREFIX}{json.dumps(state, separators=(',', ':'))}\n\n"
