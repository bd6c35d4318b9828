"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics. Bad input gets a 400 with an OpenAI error body; a client that
disconnects aborts its request (its blocks are freed)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, RemotePrefillParams
from dsv4_serving.engine.async_llm import AsyncLLM, EngineDeadError, KVTransferError
from dsv4_serving.engine.kv_connector.compat import KVCompat, KVIncompatible, KVPromptMismatch
from dsv4_serving.engine.kv_connector.validation import check_kv_request
from dsv4_serving.engine.sampling_params import SamplingParams
from dsv4_serving.engine.tokenizer import Tokenizer
from dsv4_serving.entrypoints.metrics import EngineMetrics
from dsv4_serving.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from dsv4_serving.entrypoints.serving import OpenAIServing

log = logging.getLogger(__name__)
T = TypeVar("T")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _err(message: str, status: int, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; cancel it (aborting the request) if the client goes away first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return None
    finally:
        if not task.done():
            task.cancel()


def build_app(
    engine: AsyncLLM, tokenizer: Tokenizer, model_name: str, metrics: EngineMetrics
) -> FastAPI:
    serving = OpenAIServing(engine, tokenizer, model_name)
    info = engine.info
    assert info is not None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="dsv4 engine", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _err(_validation_message(exc), 400, "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return _err(str(exc.detail), exc.status_code, type_)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _err(str(exc), 400, "BadRequestError", exc.param)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _err(str(exc), 503, "ServiceUnavailableError")

    @app.exception_handler(KVIncompatible)
    async def _incompatible(_: Request, exc: KVIncompatible) -> JSONResponse:
        log.error("refused a decode request: %s", exc)
        return _err(f"KV transfer refused (reason=incompatible): {exc}", 500,
                    "KVTransferError", "kv_transfer_params")  # fmt: skip

    @app.exception_handler(KVTransferError)
    async def _kv_failed(_: Request, exc: KVTransferError) -> JSONResponse:
        status = 500 if exc.reason == "incompatible" else 503
        return _err(f"KV transfer failed (reason={exc.reason}): {exc}", status,
                    "KVTransferError", "kv_transfer_params")  # fmt: skip

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return _err(f"internal error: {type(exc).__name__}", 500, "InternalServerError")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise BadRequest(f"The model `{name}` does not exist; this server serves "
                             f"`{model_name}`.", "model")  # fmt: skip

    def check_len(ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        if len(ids) + max_tokens > info.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {info.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the length of the prompt or "
                "max_tokens.",
                "prompt",
            )
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise BadRequest(f"token ids out of range [0, {info.vocab_size}): {bad[:5]}", "prompt")

    compat = KVCompat(info.architecture, info.block_size, info.num_speculative_tokens,
                      info.kv_dtype)  # fmt: skip
    has_connector = bool(engine.config.kv_sidecar)

    def check_kv(body: Any, ids: list[int], params: SamplingParams) -> SamplingParams:
        """The PD side of a request: refuse what this engine cannot do, before any work."""
        try:
            parsed = check_kv_request(engine.config.role, has_connector, body.kv_transfer_params)
        except ValueError as exc:
            raise BadRequest(str(exc), "kv_transfer_params") from exc
        if isinstance(parsed, PrefillRequestParams):
            if body.stream:
                raise BadRequest("a prefill for a remote decode (kv_transfer_params."
                                 "do_remote_decode) must not stream", "stream")  # fmt: skip
            # the export is the prompt's KV: one token, no stop strings cutting it short
            return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=[])
        if isinstance(parsed, RemotePrefillParams):
            try:
                compat.check(body.kv_transfer_params, ids)
            except KVPromptMismatch as exc:
                raise BadRequest(str(exc), "kv_transfer_params") from exc
        return params

    async def respond(request: Request, ids: list[int], params: Any, body: Any, chat: bool) -> Any:
        check_len(ids, params.max_tokens)
        params = check_kv(body, ids, params)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        work = serving.completion(ids, params, body.stream, include_usage, chat,
                                  body.kv_transfer_params, body.return_token_ids)  # fmt: skip
        try:
            result = await _until_disconnect(request, work)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        if result is None:  # client gone; nobody reads this
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        try:
            params = body.sampling_params()
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise BadRequest("only one prompt per request is supported", "prompt")
            p = p[0]
        ids = tokenizer.encode(p) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
        return await respond(request, ids, params, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = tokenizer.encode(tokenizer.apply_chat_template(msgs))
            default_max = max(1, info.max_model_len - len(ids))
            params = body.sampling_params(default_max)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        return await respond(request, ids, params, body, chat=True)

    @app.get("/v1/models")
    async def models() -> Any:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(started),
                    "owned_by": "dsv4",
                    "root": engine.config.model,
                    "max_model_len": info.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return _err(engine.dead_reason or "engine core is not running", 503,
                        "ServiceUnavailableError")  # fmt: skip
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    started = time.time()
    return app
