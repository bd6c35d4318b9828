"""Stop work when the client leaves: one helper for the engine's API server and the gateway."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    # the body has been read already, so the next ASGI message can only be the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; if the client goes away first, cancel it (its ``finally`` blocks abort the
    engine request or close the upstream call) and return None. Call it after the body is read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None
    finally:
        watcher.cancel()
        if not task.done():  # this coroutine itself was cancelled
            task.cancel()
