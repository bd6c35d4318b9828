"""The one error body every dsv4 HTTP server sends (engine, gateway, KV sidecar): OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``, so the ``openai`` SDK raises the
matching exception and clients read one format whichever process answered."""

from __future__ import annotations

from typing import Any

# OpenAI's ``type`` for each status class; the SDK maps the status, clients read the type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status (5xx: ``server_error``)."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def openai_error(
    status: int,
    message: str,
    *,
    code: str | None = None,
    type_: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """The body for an error response. ``code`` is a machine-readable reason (``invalid_json``,
    ``context_length_exceeded``, ...); ``type_`` defaults to the status's OpenAI type and is
    overridden only where the type itself is a contract (the PD protocol's KV-transfer error)."""
    etype = type_ or error_type(status)
    return {"error": {"message": message, "type": etype, "param": param, "code": code or etype}}
