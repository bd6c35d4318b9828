"""A fake engine on 127.0.0.1 (real HTTP, in-process): answers PD requests the way vLLM's
protocol says, or fails in one chosen way, and records what it was sent and who hung up."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from dsv4_common.errors import openai_error
from dsv4_kvtransfer.pd_protocol import KV_TRANSFER_ERROR_TYPE

Mode = Literal["ok", "fail", "kv_error", "bad_request", "hang", "break", "slow", "draining"]

TOKENS = 4  # chunks of a streamed answer
CHUNK = "data: " + json.dumps({"choices": [{"index": 0, "text": "a"}]}) + "\n\n"
STREAM = CHUNK * TOKENS + "data: [DONE]\n\n"  # a whole streamed answer
WHOLE = {"choices": [{"index": 0, "text": "a" * TOKENS}]}  # a whole answer, not streamed


@dataclass
class FakeEngine:
    """``mode`` decides every answer: ``ok``; ``fail`` (500); ``kv_error`` (503 with the PD
    protocol's KV-transfer error type); ``draining`` (503 + X-DSV4-Draining, a shutting-down
    engine); ``bad_request`` (400); ``hang`` (never answers);
    ``break`` (streams one chunk, then drops the connection); ``slow`` (streams 0.2 s apart)."""

    mode: Mode = "ok"
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    hung_up: int = 0  # requests whose client closed the connection before the answer's end
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", _empty)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", _empty)
        # cancel the handler when its client hangs up, as an engine aborts the request
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode == "draining" else 200)

    @property
    def calls(self) -> int:
        return len(self.bodies)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        try:
            return await self._answer(request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.hung_up += 1
            raise

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.mode == "fail":
            return web.json_response(openai_error(500, "engine broke"), status=500)
        if self.mode == "kv_error":
            err = openai_error(503, "KV pull failed", type_=KV_TRANSFER_ERROR_TYPE)
            return web.json_response(err, status=503)
        if self.mode == "draining":
            err = openai_error(503, "shutting down", code="draining")
            return web.json_response(err, status=503, headers={"X-DSV4-Draining": "1"})
        if self.mode == "bad_request":
            return web.json_response(openai_error(400, "temperature must be >= 0"), status=400)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):  # a prefill: one token and what the decode needs
            return web.json_response(
                {
                    "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "x"},
                }
            )
        if not body.get("stream"):
            return web.json_response(WHOLE)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(TOKENS):
            await resp.write(CHUNK.encode())
            if self.mode == "break":
                assert request.transport is not None
                await asyncio.sleep(0.1)  # the client reads the chunk before the connection drops
                request.transport.close()  # the engine dies mid-stream
                return resp
            if self.mode == "slow" and i < TOKENS - 1:
                await asyncio.sleep(0.2)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _empty(request: web.Request) -> web.Response:
    return web.Response(text="")


async def engines(*modes: Mode) -> list[FakeEngine]:
    """Started fakes in URL order, the gateway's pool order: with ``round_robin`` (or with
    ties) the first one gets the first request."""
    fakes = sorted([await FakeEngine().start() for _ in modes], key=lambda f: f.url)
    for fake, mode in zip(fakes, modes, strict=True):
        fake.mode = mode
    return fakes
