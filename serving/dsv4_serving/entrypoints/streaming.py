"""A streamed answer under the server's drain: held in flight until it is sent, and ended
with an error event, never a cut connection, when the core fails or the grace period of a
shutdown runs out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dsv4_serving.entrypoints.failures import error_event, failure, shutdown_event
from dsv4_serving.http.disconnect import Drain


async def drained(chunks: AsyncIterator[str], drain: Drain, timeout_s: float) -> AsyncIterator[str]:
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
                yield error_event(failure(exc)[1])
                return
            if chunk is None:
                yield shutdown_event(timeout_s)
                return
            yield chunk
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


class HeldStream(StreamingResponse):
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
