"""``IncrementalDetokenizer`` decodes a window per step, not the whole list: after every step
its text equals what decoding the whole list gives (trailing partial UTF-8 held back until the
end), on byte-level ids with partial characters and special tokens, and on a decoder that
strips at the start of what it decodes."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dsv4_serving.engine.engine.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer


class WholeList:
    """The oracle: the whole list decoded at each step (what the detokenizer did before)."""

    def __init__(self, tokenizer: Tokenizer, skip: bool) -> None:
        self.tokenizer, self.skip, self.text = tokenizer, skip, ""
        self.ids: list[int] = []

    def add(self, ids: list[int], final: bool) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, self.skip)
        if not final:
            text = text.rstrip("\ufffd")
        if len(text) >= len(self.text):
            self.text = text
        return self.text


def _check(tokenizer: Tokenizer, ids: list[int], skip: bool, rng: random.Random) -> None:
    detok, oracle = IncrementalDetokenizer(tokenizer, skip), WholeList(tokenizer, skip)
    i = 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 4])  # MTP steps bring several tokens
        chunk, i = ids[i : i + n], i + n
        final = i >= len(ids)
        assert detok.add(chunk, final) == oracle.add(chunk, final), (ids[:i], skip)
    assert detok.token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_ids_with_partial_characters_and_specials(skip: bool) -> None:
    tok = load_tokenizer("dsv4-tiny")  # ids 0-255 are bytes, the special tokens follow
    rng = random.Random(0)
    text = "héllo wörld, 東京 🙂 ok\n"
    utf8 = list(text.encode())
    for _ in range(200):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 60)):
            r = rng.random()
            if r < 0.6:  # runs of valid UTF-8 (multi-byte characters split over tokens)
                start = rng.randrange(len(utf8))
                ids += utf8[start : start + rng.randrange(1, 6)]
            elif r < 0.8:
                ids.append(rng.randrange(256))  # any byte: lone continuation or lead bytes
            else:
                ids.append(rng.randrange(256, tok.vocab_size))  # a special token
        _check(tok, ids, skip, rng)


def _metaspace() -> Tokenizer:
    """A decoder that drops the space of the first word it decodes (SentencePiece style)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models

    vocab = {w: i for i, w in enumerate(["<unk>", "▁hello", "▁there", "!", "▁", "x", "<s>"])}
    hf: Any = HF(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.decoder = decoders.Metaspace()
    hf.add_special_tokens(["<s>"])
    return Tokenizer(hf, None, None, None)


@pytest.mark.parametrize("skip", [True, False])
def test_a_decoder_that_strips_at_the_start_joins_exactly(skip: bool) -> None:
    tok = _metaspace()
    assert tok.decode([1, 2]) == "hello there" and tok.decode([2]) == "there"
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(1, 7) for _ in range(rng.randrange(1, 20))]
        _check(tok, ids, skip, rng)
