"""How the engine's API answers a request it could not serve: the HTTP error (status and the
common OpenAI body), or the last SSE event of a stream that had started."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from dsv4_common.errors import openai_error
from dsv4_kvtransfer.pd_protocol import KV_TRANSFER_ERROR_TYPE
from dsv4_serving.engine.engine.async_llm import EngineDeadError, KVTransferError
from dsv4_serving.http.errors import error_response

log = logging.getLogger(__name__)
SHUTDOWN_MESSAGE = "the engine shut down before this request finished (shutdown_timeout {:g}s)"


def shutdown_error(timeout_s: float) -> JSONResponse:
    return error_response(503, SHUTDOWN_MESSAGE.format(timeout_s), code="shutdown")


def shutdown_event(timeout_s: float) -> str:
    return error_event(openai_error(503, SHUTDOWN_MESSAGE.format(timeout_s), code="shutdown"))


def error_event(err: dict[str, Any]) -> str:
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n"


def failure(exc: Exception) -> tuple[int, dict[str, Any]]:
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


def validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    bad_json = any(e.get("type") == "json_invalid" for e in errors)
    code = "invalid_json" if bad_json else "invalid_request"
    return error_response(400, "; ".join(parts) or "invalid request", code=code)
