"""Prompt size and prefix block hashes for routing, without the engine (and without torch).

With a tokenizer (``--tokenizer``: a tokenizer.json or a preset), hashes are the engine's own
(``dsv4_serving.engine.core.prefix_hash``) over the engine's token ids for completions prompts; chat
messages are joined as text. Without one, UTF-8 bytes stand in for tokens: the counts are an
estimate, but equal prefixes still hash equal, which is all affinity needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsv4_serving.engine.core.prefix_hash import block_hashes

Encoder = Callable[[str], list[int]]

MAX_HASHED_TOKENS = 32768  # affinity needs the leading blocks; bound the gateway's work per request


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def load_encoder(spec: str | None) -> Encoder:
    if not spec:
        return _bytes
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(spec)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


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


def prompt_tokens(body: dict[str, Any], chat: bool, encode: Encoder) -> list[int]:
    if chat:
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


def routing_key(
    body: dict[str, Any], chat: bool, encode: Encoder, block_size: int
) -> tuple[int, list[bytes]]:
    """(prompt token count, prefix block hashes)."""
    ids = prompt_tokens(body, chat, encode)
    return len(ids), block_hashes(ids[:MAX_HASHED_TOKENS], block_size)
