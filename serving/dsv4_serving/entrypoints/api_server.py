"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions, /v1/chat/completions,
/v1/models, /health (liveness), /ready (readiness), /metrics. Every error is the common OpenAI
body (``http_errors``); bad input is a 400 decided before any work (``checks``); a client that
disconnects aborts its request (its blocks are freed). SIGTERM drains (``disconnect.Drain``):
/ready fails, new requests get 503 + X-DSV4-Draining, in-flight ones get ``shutdown_timeout``
seconds, then are stopped with an error."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from dsv4_common import tracing
from dsv4_common.errors import openai_error
from dsv4_kvtransfer.pd_protocol import (
    KV_TRANSFER_ERROR_TYPE,
    PrefillRequestParams,
    RemotePrefillParams,
    prefill_overrides,
)
from dsv4_serving.engine.engine.async_llm import AsyncLLM, EngineDeadError, KVTransferError
from dsv4_serving.engine.engine.tokenizer import Tokenizer
from dsv4_serving.engine.kv_connector.compat import KVCompat, KVIncompatible, KVPromptMismatch
from dsv4_serving.entrypoints.checks import (
    DP_RANK_HEADER,
    BadRequest,
    check_dp_rank,
    check_prompt,
    parse_kv_params,
)
from dsv4_serving.entrypoints.metrics import EngineMetrics
from dsv4_serving.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from dsv4_serving.entrypoints.serving import OpenAIServing
from dsv4_serving.entrypoints.tracing import answered, start_request_span
from dsv4_serving.http.disconnect import Drain, cancel_on_disconnect, drain_on_sigterm
from dsv4_serving.http.errors import draining_response, error_response

log = logging.getLogger(__name__)
Body = CompletionRequest | ChatCompletionRequest
SHUTDOWN_MESSAGE = "the engine shut down before this request finished (shutdown_timeout {:g}s)"


def _shutdown_error(timeout_s: float) -> JSONResponse:
    return error_response(503, SHUTDOWN_MESSAGE.format(timeout_s), code="shutdown")


def _error_event(err: dict[str, Any]) -> str:
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n"


def _failure(exc: Exception) -> tuple[int, dict[str, Any]]:
    """Status and error body of a request the engine could not serve: the HTTP answer, or the
    last event of a stream that had started."""
    if isinstance(exc, EngineDeadError):
        return 503, openai_error(503, str(exc), code="engine_unavailable")
    if isinstance(exc, KVTransferError):
        # PD protocol: a decode engine could not get the KV (policy fail), or its layout
        # differs from the prefill engine's (a deployment error: 500, never retried silently)
        status = 500 if exc.reason == "incompatible" else 503
        return status, openai_error(
            status,
            f"KV transfer failed (reason={exc.reason}): {exc}",
            code=exc.reason,
            type_=KV_TRANSFER_ERROR_TYPE,
            param="kv_transfer_params",
        )
    log.exception("internal error")
    return 500, openai_error(500, f"internal error: {type(exc).__name__}", code="internal_error")


async def _drained(
    chunks: AsyncIterator[str], drain: Drain, timeout_s: float
) -> AsyncIterator[str]:
    """The SSE stream to its end, or until the drain's grace period runs out: then an error
    event (the OpenAI SDK raises it) and [DONE]; a failure mid-stream (the core died) ends it
    the same way, never with a cut connection. Closing ``chunks`` aborts the engine request."""
    try:
        while True:
            try:
                # racing each chunk costs a task: only while draining
                chunk = await (drain.race(anext(chunks)) if drain.draining else anext(chunks))
            except StopAsyncIteration:
                return
            except Exception as exc:
                yield _error_event(_failure(exc)[1])
                return
            if chunk is None:
                yield _error_event(
                    openai_error(503, SHUTDOWN_MESSAGE.format(timeout_s), code="shutdown")
                )
                return
            yield chunk
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


class _HeldStream(StreamingResponse):
    """A streamed answer that stays in flight (``Drain.held``) until it is sent, fails or its
    client leaves, even if it never starts."""

    def __init__(self, content: AsyncIterator[str], drain: Drain, span: Any = None) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.drain = drain
        self.span = span  # tracing on: the request's span, ended with the stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.drain.held -= 1
            if self.span is not None:
                self.span.end()


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    bad_json = any(e.get("type") == "json_invalid" for e in errors)
    code = "invalid_json" if bad_json else "invalid_request"
    return error_response(400, "; ".join(parts) or "invalid request", code=code)


def build_app(
    engine: AsyncLLM, tokenizer: Tokenizer, model_name: str, metrics: EngineMetrics
) -> FastAPI:
    serving = OpenAIServing(engine, tokenizer, model_name)
    info = engine.info
    assert info is not None
    compat = KVCompat(
        info.architecture, info.block_size, info.num_speculative_tokens, info.kv_dtype
    )
    role, has_connector = engine.config.role, bool(engine.config.kv_sidecar)
    drain = Drain()
    grace = engine.config.shutdown_timeout
    tracer = tracing.setup(engine.config.otlp_traces_endpoint, f"dsv4-engine-{role}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.attach(asyncio.get_running_loop())
        drain_on_sigterm(drain, grace, log)
        yield

    app = FastAPI(title="dsv4 engine", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(400, str(exc), code=exc.code, param=exc.param)

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(KVTransferError)
    @app.exception_handler(Exception)
    async def _failed(_: Request, exc: Exception) -> JSONResponse:
        status, body = _failure(exc)
        return JSONResponse(body, status_code=status)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise BadRequest(
                f"The model `{name}` does not exist; this server serves `{model_name}`.",
                param="model",
                code="model_not_found",
            )

    def check_remote_kv(kv: RemotePrefillParams, ids: list[int]) -> None:
        try:
            compat.check(kv.extra, ids)
        except KVPromptMismatch as exc:
            raise BadRequest(
                str(exc), param="kv_transfer_params", code="kv_prompt_mismatch"
            ) from exc
        except KVIncompatible as exc:
            log.error("refused a decode request: %s", exc)
            raise KVTransferError("incompatible", str(exc)) from exc

    async def respond(request: Request, body: Body, ids: list[int]) -> Any:
        """Every check, once, then the work (cancelled if the client leaves, or stopped when a
        shutdown's grace period runs out)."""
        if drain.draining:
            return draining_response()
        arrived_ns = time.time_ns()
        chat = isinstance(body, ChatCompletionRequest)
        kv = parse_kv_params(body.kv_transfer_params, role, has_connector)
        if kv is not None and body.n != 1:
            raise BadRequest("n > 1 is not supported with kv_transfer_params", param="n")
        if isinstance(kv, PrefillRequestParams):
            if body.stream:
                raise BadRequest(
                    "a prefill for a remote decode (kv_transfer_params.do_remote_decode) must "
                    "not stream",
                    param="stream",
                )
            body = body.model_copy(update=prefill_overrides(body.model_dump()))
        try:
            params = body.sampling_params(default_max=max(1, info.max_model_len - len(ids)))
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        prompt_param = "messages" if chat else "prompt"
        check_prompt(ids, params.max_tokens, info.max_model_len, info.vocab_size, prompt_param)
        if isinstance(kv, RemotePrefillParams):
            check_remote_kv(kv, ids)
        dp_rank = check_dp_rank(request.headers.get(DP_RANK_HEADER), info.data_parallel_size)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        span = None
        if tracer is not None:
            span = start_request_span(
                tracer, request.headers, chat, model_name, role, len(ids), params.max_tokens,
                arrived_ns,
            )  # fmt: skip
        work = serving.completion(
            ids,
            params,
            body.stream,
            include_usage,
            chat,
            kv,
            body.return_token_ids,
            dp_rank,
            n=body.n,
            tokens_as_ids=body.return_tokens_as_token_ids,
            traceparent=tracing.traceparent(span) if span is not None else None,
        )
        drain.held += 1
        streaming = False
        try:
            try:
                result = await cancel_on_disconnect(request, drain.race(work))
            except ValueError as exc:  # the core refused it
                raise BadRequest(str(exc)) from exc
            if result is None:
                if drain.expired.is_set():
                    return _shutdown_error(grace)
                return Response(status_code=499)  # client gone; nobody reads this
            if isinstance(result, dict):
                if span is not None:
                    answered(span, result)
                return JSONResponse(result)
            streaming = True  # the stream is in flight until it is sent
            return _HeldStream(_drained(result, drain, grace), drain, span)
        except Exception as exc:
            if span is not None:
                tracing.fail(span, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if not streaming:
                drain.held -= 1
                if span is not None:
                    span.end()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise BadRequest("only one prompt per request is supported", param="prompt")
            p = p[0]
        # p is now one prompt: text or token ids (pydantic checked the shapes)
        ids = tokenizer.encode(p) if isinstance(p, str) else cast(list[int], list(p))
        return await respond(request, body, ids)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = tokenizer.encode(tokenizer.apply_chat_template(msgs))
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from exc
        return await respond(request, body, ids)

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
            reason = engine.dead_reason or "engine core is not running"
            return error_response(503, reason, code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the model is loaded (it is before the app exists) and not draining."""
        if not engine.alive:
            reason = engine.dead_reason or "engine core is not running"
            return error_response(503, reason, code="engine_unavailable")
        if drain.draining:
            return error_response(503, "shutting down", code="draining")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    started = time.time()
    app.state.drain = drain
    return app
