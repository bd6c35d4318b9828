"""The engine's and the gateway's error responses: ``dsv4_common.errors``'s one OpenAI body,
as a Starlette response."""

from __future__ import annotations

from starlette.responses import JSONResponse

from dsv4_common.errors import openai_error


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    type_: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        openai_error(status, message, code=code, type_=type_, param=param),
        status_code=status,
        headers=headers,
    )
