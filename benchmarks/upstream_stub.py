"""A fast OpenAI-compatible upstream that speaks vLLM's PD protocol, for measuring what a router
adds. Answers at once: a prefill request (kv_transfer_params.do_remote_decode) with one token and
the params a decode needs; any other request with ``--tokens`` tokens (streamed or not).

    python benchmarks/upstream_stub.py --port 9001 --tokens 16

Not a test double of the engine: a harness whose own latency is near zero, so that the figure a
benchmark reports is the router's.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import uvicorn

from dsv4_common.errors import openai_error

Scope = dict[str, Any]


class StubApp:
    """The ASGI app: a prefill answer with the params a decode needs, or ``tokens`` tokens."""

    def __init__(self, tokens: int, engine_id: str) -> None:
        self.tokens = tokens
        self.engine_id = engine_id

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        path, method = scope["path"], scope["method"]
        if method == "GET":
            return await _get(send, path)
        req = json.loads(await _body(receive) or b"{}")
        rid = f"cmpl-{uuid.uuid4().hex}"
        params = req.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return await _json(send, 200, self._prefill_answer(rid))
        n = int(req.get("max_tokens") or self.tokens)
        if req.get("stream"):
            return await _stream(send, rid, n)
        return await _json(
            send,
            200,
            {
                "id": rid,
                "object": "text_completion",
                "model": "stub",
                "choices": [{"index": 0, "text": "a" * n, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
            },
        )

    def _prefill_answer(self, rid: str) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": "stub",
            "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": rid,
                "remote_block_ids": [0, 1],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
            },
        }


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _get(send: Any, path: str) -> None:
    if path == "/v1/models":
        body = {"object": "list", "data": [{"id": "stub", "object": "model"}]}
        return await _json(send, 200, body)
    if path in ("/health", "/metrics"):
        return await _raw(send, 200, b"", b"text/plain")
    return await _json(send, 404, openai_error(404, f"no route {path}"))


async def _body(receive: Any) -> bytes:
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            return raw


async def _stream(send: Any, rid: str, n: int) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for i in range(n):
        chunk = {
            "id": rid,
            "object": "text_completion",
            "choices": [
                {"index": 0, "text": "a", "finish_reason": None if i < n - 1 else "length"}
            ],
        }
        await send(
            {
                "type": "http.response.body",
                "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                "more_body": True,
            }
        )
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _raw(send: Any, status: int, body: bytes, ctype: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _json(send: Any, status: int, obj: Any) -> None:
    await _raw(send, status, json.dumps(obj).encode(), b"application/json")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    uvicorn.run(
        StubApp(args.tokens, f"stub-{args.port}"),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
