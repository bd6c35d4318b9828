"""The grammars of the requests a sampling rank runs: one matcher per request, its mask rows
for a step (one per draft plus one), advanced with verified tokens only.

Lifecycle: ``add`` when the core accepts a request (the grammar may still be compiling:
a future), the matcher made at the request's first sample, ``drop`` when the request is gone
(finished, aborted). The matcher never sees a draft for good: drafts are checked with
``validate`` and walked with ``accept`` + ``rollback`` to fill their rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from dsv4_serving.structured.backend import Bitmask, CompiledGrammar, GrammarMatcher, bitmask_words

log = logging.getLogger(__name__)


class RequestGrammars:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._pending: dict[str, Future[CompiledGrammar]] = {}
        self._matchers: dict[str, GrammarMatcher | None] = {}  # None: its grammar failed
        self._replay: dict[str, Sequence[int]] = {}

    def add(
        self, request_id: str, grammar: Future[CompiledGrammar], replay: Sequence[int] = ()
    ) -> None:
        """``replay``: output generated before (a continued stream), accepted by the matcher
        before its first mask, so the continuation is constrained as the first engine was."""
        self._pending[request_id] = grammar
        if replay:
            self._replay[request_id] = replay

    def drop(self, request_id: str) -> None:
        fut = self._pending.pop(request_id, None)
        if fut is not None:
            fut.cancel()
        self._replay.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending or request_id in self._matchers

    def __len__(self) -> int:
        return len(self._pending) + len(self._matchers)

    def _matcher(self, request_id: str) -> GrammarMatcher | None:
        if request_id in self._matchers:
            return self._matchers[request_id]
        fut = self._pending.pop(request_id)
        m: GrammarMatcher | None
        try:
            m = fut.result().matcher()  # waits only if the compile has not finished yet
        except ValueError as exc:
            # the API server checks every spec with the same library first: cannot happen
            # through HTTP; an in-process caller's bad spec ends its request at once (EOS only)
            log.error("request %s: its grammar did not compile: %s", request_id, exc)
            m = None
        replay = self._replay.pop(request_id, ())
        if m is not None and not self._replayed(m, replay):
            # not what this grammar allows: never from a gateway's continuation (the first
            # engine was constrained by the same grammar); ends the request (EOS only)
            log.error("request %s: its continued output is outside its grammar", request_id)
            m = None
        self._matchers[request_id] = m
        return m

    def _replayed(self, m: GrammarMatcher, token_ids: Sequence[int]) -> bool:
        for t in token_ids:
            if m.is_terminated() and t in self.eos_token_ids:
                continue
            if not m.accept(t):
                return False
        return True

    def rows(self, request_id: str, drafts: Sequence[int]) -> tuple[Bitmask, int]:
        """Mask rows ``[kept + 1, words]`` and ``kept``: how many leading drafts the grammar
        accepts (the rest are rejected without being looked at). Row i is the mask after
        ``drafts[:i]``; the matcher's state is unchanged."""
        m = self._matcher(request_id)
        words = bitmask_words(self.vocab_size)
        if m is None:
            bits = np.zeros((1, words), dtype=np.uint32)
            for t in self.eos_token_ids:
                bits[0, t // 32] |= np.uint32(1 << (t % 32))
            return bits.view(np.int32), 0
        kept = m.validate(list(drafts)) if drafts and not m.is_terminated() else 0
        rows = np.zeros((kept + 1, words), dtype=np.int32)
        m.fill_bitmask(rows[0])
        for i in range(kept):
            if not m.accept(drafts[i]):  # validate said it would: a library bug
                raise AssertionError(f"{request_id}: draft {drafts[i]} refused: {m.error()}")
            m.fill_bitmask(rows[i + 1])
        if kept:
            m.rollback(kept)
        return rows, kept

    def advance(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The verified tokens of a step (each was allowed by its row)."""
        if request_id not in self:
            return
        m = self._matcher(request_id)
        if m is None:
            return
        for t in token_ids:
            if m.is_terminated() and t in self.eos_token_ids:
                continue  # EOS again (min_tokens, ignore_eos): the grammar stays complete
            if not m.accept(t):
                raise AssertionError(f"{request_id}: token {t} outside its mask: {m.error()}")
