"""A byte-level tokenizer (256 byte tokens + DeepSeek V4's added tokens), no merges.

The added tokens are those of DeepSeek V4's tokenizer that its chat format writes (ids 0, 1,
128803, 128804, 128821, 128822, 128825 and 128828 there), each one id here too, so the tiny
presets run the real encoding and parsing path. As in DeepSeek's released tokenizers, only BOS
and EOS are special (``skip_special_tokens`` drops them); the chat markers, the think tags and
the DSML marker ``｜DSML｜`` survive decoding. V4 has no token for ``<｜DSML｜`` as a whole: the
``<`` (or ``</``) before the marker is a byte.
"""

# DeepSeek's special tokens are spelled with fullwidth bars and U+2581 on purpose.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsv4_serving.presets.configs import SPECIAL_TOKENS, preset_config

SKIPPED = frozenset(SPECIAL_TOKENS[:2])
"""The added tokens ``skip_special_tokens`` drops: BOS and EOS."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def build_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer``: ids 0-255 are bytes, specials follow."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=t in SKIPPED, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table (what ByteLevel uses)
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def write_preset(name: str, directory: str | Path) -> Path:
    """Write ``config.json`` and the tokenizer files of preset ``name`` into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = preset_config(name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok = build_tokenizer()
    if tok.get_vocab_size() != config["vocab_size"]:
        raise AssertionError("preset vocab_size must equal the tokenizer's size")
    tok.save(str(out / "tokenizer.json"))
    specials = list(SPECIAL_TOKENS)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": specials[0],
                "eos_token": specials[1],
                "pad_token": specials[1],
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": config["max_position_embeddings"],
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
    return out
