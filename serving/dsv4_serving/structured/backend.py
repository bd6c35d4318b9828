"""The narrow interface between the engine and a grammar library.

A backend compiles a ``GrammarSpec`` once (cached by ``manager.py``); each request gets its
own matcher from the compiled grammar. Matchers advance only with *verified* tokens; drafts
are checked with ``validate`` (which does not advance).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from dsv4_serving.structured.spec import GrammarSpec

Bitmask = npt.NDArray[np.int32]  # packed: bit t % 32 of word t // 32 set = token t allowed


def bitmask_words(vocab_size: int) -> int:
    """Words of one packed mask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class GrammarMatcher(Protocol):
    """One request's position in a grammar."""

    def fill_bitmask(self, row: Bitmask) -> None:
        """Write the tokens allowed next into ``row`` (one C-contiguous int32 row)."""

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and an error state) if the grammar refuses it."""

    def validate(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar accepts in a row; the state is unchanged."""

    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (or EOS was accepted)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def error(self) -> str:
        """Why the matcher refused a token ("" when it did not)."""


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(Protocol):
    vocab_size: int  # mask width: the model's logits width (ids past the tokenizer never allowed)

    def check(self, spec: GrammarSpec) -> None:
        """Raise ``GrammarSpecError`` if ``spec`` cannot be compiled (cheap: the API's 400)."""

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec``; raises ``GrammarSpecError``."""
