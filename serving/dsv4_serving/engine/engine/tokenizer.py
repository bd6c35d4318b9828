"""Text <-> token ids for the front end (the engine core sees tokens only): a checkpoint's
``tokenizer.json`` + ``tokenizer_config.json`` chat template, or a preset's built-in ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(
        self, tok: Any, chat_template: str | None, bos_token: str | None, eos_token: str | None
    ) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: Any = None

    @property
    def hf(self) -> Any:
        """The HuggingFace ``tokenizers.Tokenizer`` (what a grammar library reads)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one token of the vocabulary (an added token)."""
        found = self._tok.token_to_id(text)
        return None if found is None else int(found)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        return str(
            self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        )


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


def load_tokenizer(model: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    from dsv4_serving.presets.configs import PRESETS, SPECIAL_TOKENS

    if model in PRESETS:
        from dsv4_serving.presets.tokenizer import CHAT_TEMPLATE, build_tokenizer

        return Tokenizer(build_tokenizer(), CHAT_TEMPLATE, SPECIAL_TOKENS[0], SPECIAL_TOKENS[1])
    root = Path(model)
    root = root if root.is_dir() else root.parent
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the engine needs the checkpoint's tokenizer")
    cfg_path = root / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    return Tokenizer(
        HFTokenizer.from_file(str(path)),
        cfg.get("chat_template"),
        _token_text(cfg.get("bos_token")),
        _token_text(cfg.get("eos_token")),
    )


class IncrementalDetokenizer:
    """Text of a growing list of ids; a trailing partial UTF-8 sequence is held back.
    ``skip_special_tokens`` False keeps added tokens' text (what the chat output parser reads).

    Each ``add`` decodes a window, not the whole list (which made a step's detokenisation grow
    with every sequence's length): the tokens whose text came last (context, so a decoder that
    strips or joins at the start of what it decodes treats the new tokens as it would in the
    whole list) and the new ones; the new text is what the window adds to its context's. The
    window's start is always where the text so far decoded completely (no partial UTF-8 held
    back), so the decoder's state there is clean and the pieces join into the whole list's
    text exactly (vLLM's prefix/read offsets)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._done = ""  # the text of the tokens before ``_read``, decoded completely
        self._prefix = 0  # the window's first token (its context's)
        self._read = 0

    def add(self, ids: list[int], final: bool) -> str:
        self.token_ids.extend(ids)
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        context = decode(self.token_ids[self._prefix : self._read], skip)
        new = decode(self.token_ids[self._prefix :], skip)[len(context) :]
        if new and not new.endswith("\ufffd"):
            # a clean boundary: the next window starts at these tokens. Not after tokens that
            # add no text (skipped special tokens): the context must hold text.
            self._done += new
            self._prefix, self._read = self._read, len(self.token_ids)
            text = self._done
        else:
            text = self._done + (new if final else new.rstrip("\ufffd"))
        if len(text) >= len(self.text):  # else held-back bytes resolved to fewer characters
            self.text = text
        return self.text
