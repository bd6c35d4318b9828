"""OpenAI-style error responses."""

from __future__ import annotations

from starlette.responses import JSONResponse


def error(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "code": code or type_, "param": None}},
        status_code=status,
        headers=headers,
    )


def bad_request(message: str, code: str = "invalid_request") -> JSONResponse:
    return error(400, message, "invalid_request_error", code)
