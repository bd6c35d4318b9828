"""The engine's and the gateway's error responses: ``dsv4_common.errors``'s one OpenAI body,
as a Starlette response."""

from __future__ import annotations

from starlette.responses import JSONResponse

from dsv4_common.errors import openai_error

DRAINING_HEADER = "X-DSV4-Draining"
"""On a 503: the instance is shutting down; the request did no work and may go elsewhere."""


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


def draining_response(what: str = "this engine") -> JSONResponse:
    """503 for a request refused by a server that is shutting down: it did no work, so the
    gateway (which knows the header) sends it to another instance."""
    return error_response(
        503,
        f"{what} is shutting down and takes no new requests; retry on another instance",
        code="draining",
        headers={DRAINING_HEADER: "1"},
    )
