"""The one error of the control API: what the sidecar refuses an engine, and why."""

from __future__ import annotations


class ApiError(Exception):
    """An engine request the sidecar refuses: HTTP ``status``, a short machine-readable ``code``
    (``bad_request``, ``staging_full``, ``unknown_transfer``, ...) and, for a bad body, the
    ``param`` at fault; the control API answers it as ``dsv4_common.errors.openai_error``."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
