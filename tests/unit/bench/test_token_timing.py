"""The load client times a token where the gateway's histograms do (``carries_text``): a chunk
whose text is empty in an unfinished choice is a token whose bytes do not make a character yet."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from dsv4_serving.bench.client import Prompt, one_request

pytestmark = pytest.mark.unit


def _sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def _choice(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_an_empty_token_in_an_unfinished_choice_is_timed_and_counted() -> None:
    body = _sse(
        _choice("a"),
        _choice(""),  # a token of an incomplete UTF-8 character
        _choice("b"),
        _choice("", "length"),  # the finish: no token
        b"[DONE]",
    )
    transport = httpx.MockTransport(lambda _req: httpx.Response(200, content=body))

    async def go() -> object:
        async with httpx.AsyncClient(transport=transport) as client:
            prompt = Prompt(body={"prompt": "x", "stream": True}, prompt_tokens=1)
            return await one_request(client, "http://gw/v1/completions", prompt, {}, 5.0)

    rec = asyncio.run(go())
    assert rec.ok and not rec.error  # type: ignore[attr-defined]
    assert len(rec.itl) == 2  # type: ignore[attr-defined]
    assert rec.output_tokens == 3  # type: ignore[attr-defined]
