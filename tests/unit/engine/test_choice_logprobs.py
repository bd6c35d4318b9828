"""Logprobs in the OpenAI formats and the seeds of ``n`` samples: pure rendering, exact values,
with dsv4-tiny's byte-level tokenizer (bytes 128-255 are no text on their own)."""

from __future__ import annotations

import codecs
import math
import random

from dsv4_serving.engine.engine.tokenizer import load_tokenizer
from dsv4_serving.engine.request import Logprob
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.entrypoints.logprobs import ChoiceLogprobs
from dsv4_serving.entrypoints.serving import sample_params

TOK = load_tokenizer("dsv4-tiny")
E_ACUTE = list("é".encode())  # [0xC3, 0xA9]: two tokens, neither text alone


def test_partial_characters_get_distinct_keys_and_the_sampled_token_comes_first() -> None:
    lp = ChoiceLogprobs(TOK, chat=False)
    steps = [
        Logprob(0xC3, -0.5, [(ord("a"), -0.1), (0xC3, -0.5), (0xC4, -2.0)]),
        Logprob(0xA9, -0.25, [(0xA8, -0.2), (ord("b"), -3.0)]),
    ]
    out = lp.render(steps)
    assert out == {
        "tokens": ["token_id:195", "token_id:169"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [
            {"token_id:195": -0.5, "a": -0.1, "token_id:196": -2.0},
            {"token_id:169": -0.25, "token_id:168": -0.2, "b": -3.0},
        ],
        "text_offset": [0, 0],
    }


def test_text_offset_counts_characters_across_increments() -> None:
    lp = ChoiceLogprobs(TOK, chat=False)
    first = lp.render([Logprob(ord("h"), -1.0, []), Logprob(ord("i"), -1.0, [])])
    ids = [*E_ACUTE, ord("!")]
    second = lp.render([Logprob(i, -1.0, []) for i in ids])
    assert first is not None and second is not None
    # "hi" then "é!": é starts at 2, its second byte too (no new character yet), "!" at 3
    assert first["text_offset"] == [0, 1] and second["text_offset"] == [2, 2, 3]
    assert second["tokens"] == ["token_id:195", "token_id:169", "!"]


def test_token_ids_spelling_and_the_json_safe_floor() -> None:
    lp = ChoiceLogprobs(TOK, chat=False, as_token_ids=True)
    out = lp.render([Logprob(ord("a"), -math.inf, [(ord("b"), -1.0)])])
    assert out is not None
    assert out["tokens"] == ["token_id:97"] and out["token_logprobs"] == [-9999.0]
    assert out["top_logprobs"] == [{"token_id:97": -9999.0, "token_id:98": -1.0}]


def test_chat_entries_carry_bytes_only_for_whole_characters() -> None:
    lp = ChoiceLogprobs(TOK, chat=True)
    out = lp.render([Logprob(ord("a"), -0.5, [(0xC3, -1.0)])])
    assert out == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [{"token": "token_id:195", "logprob": -1.0, "bytes": None}],
            }
        ]
    }
    assert lp.render(None) is None


def test_sample_i_uses_seed_plus_i_and_unseeded_samples_stay_unseeded() -> None:
    p = SamplingParams(seed=7, temperature=1.0)
    assert [sample_params(p, i).seed for i in range(3)] == [7, 8, 9]
    assert sample_params(p, 0) is p
    q = SamplingParams(temperature=1.0)
    assert sample_params(q, 2).seed is None
    assert sample_params(SamplingParams(seed=2**63 - 1), 1).seed == 0


def _offsets_point_at_their_tokens(ids: list[int], chunks: list[int]) -> list[int]:
    """Render ``ids`` in chunks of the given sizes; check each offset against the text."""
    lp = ChoiceLogprobs(TOK, chat=False)
    offsets: list[int] = []
    start = 0
    for size in chunks:
        end = start + size
        out = lp.render([Logprob(i, -1.0, []) for i in ids[start:end]])
        assert out is not None
        offsets += out["text_offset"]
        start = end
    return offsets


def test_text_offset_points_at_each_token_past_split_characters_and_a_real_fffd() -> None:
    # "a" "中"(3 byte tokens) "�"(a real U+FFFD: 3 byte tokens) "b" "é"(2) "c"
    ids = [ord("a"), *"中".encode(), *"\ufffd".encode(), ord("b"), *E_ACUTE, ord("c")]
    text = TOK.decode(ids)
    assert text == "a中\ufffdbéc"
    # each token's offset: the character holding its first byte
    want = [0, 1, 1, 1, 2, 2, 2, 3, 4, 4, 5]
    assert _offsets_point_at_their_tokens(ids, [len(ids)]) == want
    for k in (1, 2, 3):  # streamed, k tokens a chunk: the same offsets
        sizes = [k] * (len(ids) // k) + ([len(ids) % k] if len(ids) % k else [])
        assert _offsets_point_at_their_tokens(ids, sizes) == want
    # the old rule dropped every trailing U+FFFD: "b" came out at 2, on the U+FFFD
    assert text[want[7]] == "b"


def test_text_offset_after_bytes_that_never_become_a_character() -> None:
    ids = [0xE4, ord("x"), ord("y")]  # a lone lead byte: U+FFFD in the text, then "xy"
    assert TOK.decode(ids) == "\ufffdxy"
    assert _offsets_point_at_their_tokens(ids, [3]) == [0, 1, 2]


def _byte_truth(ids: list[int]) -> list[int]:
    """Each byte token's character, by Python's own UTF-8 decoder: the character being written
    while bytes are pending, else the last one written."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    chars, out = 0, []
    for b in ids:
        chars += len(decoder.decode(bytes([b])))
        out.append(chars if decoder.getstate()[0] else chars - 1)
    return out


def test_text_offset_is_the_same_however_the_tokens_are_grouped() -> None:
    """Random byte soup (what a random tiny model writes): every grouping of the tokens into
    increments, and a stream continued after any cut (``prime``), gives the one-by-one offsets,
    and those are the characters Python's decoder puts each byte in. Lead bytes whose second
    byte's range is narrowed (E0, ED, F0, F4) or never valid (F5-FF) are left out of that last
    check: Python decides those one byte later than the tokenizer's (Rust) decoder."""
    rng = random.Random(0)
    alphabet = [*b"ab ", *"é中\ufffd😀".encode(), 0xE4, 0x80, 0xC3, 0xE0, 0xF0, 0xED]
    narrowed = {0xE0, 0xED, 0xF0, 0xF4, *range(0xF5, 256)}
    for _ in range(500):
        ids = [rng.choice(alphabet) if rng.random() < 0.7 else rng.randrange(256) for _ in range(9)]
        one_by_one = _offsets_point_at_their_tokens(ids, [1] * len(ids))
        if not narrowed & set(ids):
            assert one_by_one == _byte_truth(ids), ids
        cuts = sorted(rng.sample(range(1, len(ids)), 3))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        assert _offsets_point_at_their_tokens(ids, sizes) == one_by_one, (ids, sizes)
        lp = ChoiceLogprobs(TOK, chat=False)
        lp.prime(ids[: cuts[0]])
        out = lp.render([Logprob(i, -1.0, []) for i in ids[cuts[0] :]])
        assert out is not None and out["text_offset"] == one_by_one[cuts[0] :], ids


def test_a_token_after_an_invalid_byte_starts_a_new_character() -> None:
    # "3p", a stray continuation byte (settled U+FFFD), a lead byte cut off by "b" (another)
    ids = [51, 112, 0xBF, 0xEF, ord("b")]
    assert TOK.decode(ids) == "3p\ufffd\ufffdb"
    want = [0, 1, 2, 3, 4]
    assert _offsets_point_at_their_tokens(ids, [1] * 5) == want
    assert _offsets_point_at_their_tokens(ids, [5]) == want
