"""Prompt size and prefix block hashes for routing, without the engine (and without torch).

With a tokenizer (``--tokenizer``: a preset, a checkpoint directory, or its tokenizer.json),
hashes are the engine's own (``dsv4_serving.engine.core.prefix_hash``) over the engine's token ids:
completions prompts are encoded as the engine encodes them, and a chat of a model in DeepSeek's
format is rendered by the engine's own renderer (``chat/request.py``: system prompt, tools,
thinking switches and all), so two chats sharing a system prompt and tools share their leading
blocks here exactly as in the engine's cache. A chat the renderer refuses (the engine answers it
with a 400) and a Jinja-format model's chat fall back to role and content joined as text. Without
a tokenizer, UTF-8 bytes stand in for tokens: the counts are an estimate, but equal prefixes
still hash equal, which is all affinity needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_serving.chat.registry import ChatFormat
from dsv4_serving.chat.request import chat_format_of, render_chat
from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.gateway.scorers import RouteRequest

Encoder = Callable[[str], list[int]]

MAX_HASHED_TOKENS = 32768  # affinity needs the leading blocks; bound the gateway's work per request


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


@dataclass(frozen=True, slots=True)
class PromptEncoder:
    """Text -> ids, and (with a DeepSeek-format model) a chat body -> its rendered prompt."""

    encode: Encoder
    chat_format: ChatFormat | None = None
    default_thinking: bool = True

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)

    def chat(self, body: dict[str, Any]) -> list[int] | None:
        """The engine's prompt ids of a chat; None when it is not rendered here."""
        fmt = self.chat_format
        messages = body.get("messages")
        if fmt is None or fmt.is_jinja or not isinstance(messages, list):
            return None
        try:
            text = render_chat(fmt, messages, body, self.default_thinking).text
        except Exception:
            return None
        return self.encode(text)


def load_encoder(
    spec: str | None, chat_format: str = "auto", default_thinking: bool = True
) -> PromptEncoder:
    """``spec``: a preset name, a checkpoint directory, or a tokenizer.json (its directory's
    config.json names the chat format); None: bytes, and chats joined as text."""
    if not spec:
        return PromptEncoder(_bytes)
    from dsv4_serving.presets.configs import PRESETS

    if spec in PRESETS:
        from dsv4_serving.presets.tokenizer import build_tokenizer

        tok = build_tokenizer()
    else:
        from tokenizers import Tokenizer

        path = Path(spec)
        tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return PromptEncoder(
        lambda text: list(tok.encode(text, add_special_tokens=False).ids),
        chat_format_of(spec, chat_format),
        default_thinking,
    )


def _text_of_messages(messages: Any) -> str:
    parts = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def prompt_tokens(body: dict[str, Any], chat: bool, encode: PromptEncoder | Encoder) -> list[int]:
    if chat:
        rendered = encode.chat(body) if isinstance(encode, PromptEncoder) else None
        if rendered is not None:
            return rendered
        return encode(_text_of_messages(body.get("messages")))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):  # a batch: route by the first, count them all
        first = prompt_tokens({"prompt": prompt[0]}, False, encode) if prompt else []
        return first + [0] * sum(
            len(prompt_tokens({"prompt": p}, False, encode)) for p in prompt[1:]
        )
    return []


def route_request(
    body: dict[str, Any], chat: bool, encode: PromptEncoder | Encoder, block_size: int
) -> RouteRequest:
    """What routing sees of a request: its token count and the hashes of its first blocks
    (the engine's hash of the engine's ids), with those ids for snapshot look-ups."""
    ids = prompt_tokens(body, chat, encode)
    head = ids[:MAX_HASHED_TOKENS]
    return RouteRequest(len(ids), block_hashes(head, block_size), block_size, token_ids=head)
