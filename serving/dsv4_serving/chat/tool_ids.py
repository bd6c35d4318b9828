"""Tool-call ids: made once per call, when the parser emits the call's first event.

OpenAI-shaped (``call_`` + 24 hex). Random by default; ``derived_tool_call_id`` gives the same id
for the same request, choice and call index (so a retried or replayed stream repeats its ids).
"""

from __future__ import annotations

import hashlib
import secrets


def random_tool_call_id(index: int = 0) -> str:
    del index  # the same signature as a derived factory
    return "call_" + secrets.token_hex(12)


def derived_tool_call_id(request_id: str, choice: int, index: int) -> str:
    digest = hashlib.blake2b(f"{request_id}/{choice}/{index}".encode(), digest_size=12)
    return "call_" + digest.hexdigest()
