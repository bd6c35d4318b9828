"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions, /v1/chat/completions,
/v1/models, /health (liveness), /ready (readiness), /metrics, /debug/host_times (host time
per step by phase). Every error is the common OpenAI
body (``http_errors``); bad input is a 400 decided before any work (``checks``); a client that
disconnects aborts its request (its blocks are freed). SIGTERM drains (``disconnect.Drain``):
/ready fails, new requests get 503 + X-DSV4-Draining, in-flight ones get ``shutdown_timeout``
seconds, then are stopped with an error.

vLLM's shape: the routes are this module's, the work is the serving classes' (``serving_*``),
which ``build_app`` puts in the app's state."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import State
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4_common import tracing
from dsv4_serving.engine.engine.async_llm import AsyncLLM, EngineDeadError, KVTransferError
from dsv4_serving.engine.engine.tokenizer import Tokenizer
from dsv4_serving.entrypoints.checks import BadRequest
from dsv4_serving.entrypoints.failures import failure, validation_error
from dsv4_serving.entrypoints.metrics import EngineMetrics
from dsv4_serving.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from dsv4_serving.entrypoints.serving_chat import OpenAIServingChat
from dsv4_serving.entrypoints.serving_completion import OpenAIServingCompletion
from dsv4_serving.entrypoints.serving_models import OpenAIServingModels
from dsv4_serving.http.disconnect import Drain, drain_on_sigterm
from dsv4_serving.http.errors import error_response

log = logging.getLogger(__name__)
router = APIRouter()


def _state(request: Request) -> State:
    state: State = request.app.state
    return state


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    serving: OpenAIServingCompletion = _state(request).openai_serving_completion
    return await serving.create_completion(body, request)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request) -> Any:
    serving: OpenAIServingChat = _state(request).openai_serving_chat
    return await serving.create_chat_completion(body, request)


@router.get("/v1/models")
async def models(request: Request) -> Any:
    serving: OpenAIServingModels = _state(request).openai_serving_models
    return serving.show_available_models()


def _engine_down(engine: AsyncLLM) -> Response | None:
    if engine.alive:
        return None
    reason = engine.dead_reason or "engine core is not running"
    return error_response(503, reason, code="engine_unavailable")


@router.get("/health")
async def health(request: Request) -> Response:
    return _engine_down(_state(request).engine) or Response(status_code=200)


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: the model is loaded (it is before the app exists) and not draining."""
    state = _state(request)
    down = _engine_down(state.engine)
    if down is not None:
        return down
    if state.drain.draining:
        return error_response(503, "shutting down", code="draining")
    return Response(status_code=200)


@router.post("/drain")
async def drain(request: Request) -> Response:
    """Drain without waiting for the longest answer: ``/ready`` turns 503 and new requests get
    503 + X-DSV4-Draining (as after SIGTERM, but the process stays up), and every stream a
    gateway can continue (one that asked for stream state) moves to another engine: at its
    next step its KV is exported through the KV sidecar and its stream ends with a migrate
    block the gateway resumes it from (``engine/engine/drain.py``). Other requests finish here.
    Body (optional): ``{"migrate": false}`` only stops admitting. Answer: ``{"draining": true,
    "migrating": <streams asked to move>, "in_flight": <requests in flight here>,
    "kv": <whether their KV moves (a sidecar) or is recomputed where they go>}``. Idempotent:
    a second call moves what is left."""
    state = _state(request)
    engine: AsyncLLM = state.engine
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return error_response(400, "the body must be JSON", code="invalid_json")
    if not isinstance(body, dict) or not isinstance(body.get("migrate", True), bool):
        return error_response(400, 'the body is {"migrate": bool}', param="migrate")
    unknown = sorted(set(body) - {"migrate"})
    if unknown:
        return error_response(400, f"unknown fields {unknown}", param=unknown[0])
    state.drain.draining = True
    moving = engine.migrate() if body.get("migrate", True) else 0
    log.info("drain asked: %d stream(s) moving", moving)
    answer = {
        "draining": True,
        "migrating": moving,
        "in_flight": state.drain.inflight(),
        "kv": engine.config.kv_sidecar is not None,
    }
    return JSONResponse(answer)


@router.delete("/drain")
async def undrain(request: Request) -> Response:
    """Admit again after ``POST /drain`` (a scale-down called off): ``/ready`` is 200 again
    and the gateways route here once their health check sees it. A SIGTERM's drain cannot be
    called off (409)."""
    drain = _state(request).drain
    if drain.task is not None:
        return error_response(409, "shutting down (SIGTERM)", code="draining")
    drain.draining = False
    return JSONResponse({"draining": False})


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    metrics: EngineMetrics = _state(request).metrics
    return Response(metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/debug/host_times")
async def host_times(request: Request, reset: bool = False) -> dict[str, dict[str, float]]:
    """Host time per step by phase, p50 / p99 over the last steps (``engine/host_times.py``);
    ``reset=true`` starts a new window after this answer (a benchmark's run)."""
    engine: AsyncLLM = _state(request).engine
    summary = engine.host_times.summary()
    if reset:
        engine.host_times.reset()
    return summary


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc)


async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
    return error_response(400, str(exc), code=exc.code, param=exc.param)


async def _failed(_: Request, exc: Exception) -> JSONResponse:
    status, body = failure(exc)
    return JSONResponse(body, status_code=status)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine: AsyncLLM = app.state.engine
    engine.attach(asyncio.get_running_loop())
    if engine.config.kv_sidecar:  # SIGTERM moves the streams (their KV) rather than waits
        app.state.drain.on_start = engine.migrate
    drain_on_sigterm(app.state.drain, engine.config.shutdown_timeout, log)
    yield


def init_app_state(
    state: State, engine: AsyncLLM, tokenizer: Tokenizer, model_name: str, metrics: EngineMetrics
) -> None:
    """The serving classes, over one drain and one tracer."""
    drain = Drain()
    tracer = tracing.setup(engine.config.otlp_traces_endpoint, f"dsv4-engine-{engine.config.role}")
    shared = (engine, tokenizer, model_name, drain, tracer)
    state.engine, state.metrics, state.drain = engine, metrics, drain
    state.openai_serving_completion = OpenAIServingCompletion(*shared)
    state.openai_serving_chat = OpenAIServingChat(*shared)
    state.openai_serving_models = OpenAIServingModels(engine, model_name)


def build_app(
    engine: AsyncLLM, tokenizer: Tokenizer, model_name: str, metrics: EngineMetrics
) -> FastAPI:
    app = FastAPI(
        title="dsv4 engine",
        lifespan=lifespan,
        exception_handlers={
            RequestValidationError: _invalid,
            StarletteHTTPException: _http,
            BadRequest: _bad,
            # the core's failures are expected answers; any other error is a server error
            # (Starlette answers it, then re-raises it for the log)
            Exception: _failed,
            KVTransferError: _failed,
            EngineDeadError: _failed,
        },
    )
    app.include_router(router)
    init_app_state(app.state, engine, tokenizer, model_name, metrics)
    return app
