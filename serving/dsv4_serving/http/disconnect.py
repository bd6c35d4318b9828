"""Stop work when one side goes away: the client (``cancel_on_disconnect``) or the server itself
(``Drain``, a graceful shutdown on SIGTERM). One helper each for the engine's API server and the
gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    # the body has been read already, so the next ASGI message can only be the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless(work: Awaitable[T], stop: Awaitable[object]) -> T | None:
    """``work``'s result; if ``stop`` completes first, ``work`` is cancelled (its ``finally``
    blocks abort the engine request or close the upstream call) and the answer is None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(stop)
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


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; if the client goes away first, cancel it and return None. Call it after the
    body is read."""
    return await _unless(work, _disconnected(request))


class Drain:
    """A server's graceful shutdown: once ``run`` starts, readiness fails and new work is
    refused; in-flight work (``inflight()``) gets up to ``timeout_s`` to finish, then
    ``expired`` is set and what is left is stopped with a clear error."""

    def __init__(self, inflight: Callable[[], int] | None = None, poll_s: float = 0.05) -> None:
        self.held = 0
        """Requests in flight, when the server counts them here (``inflight`` unset)."""
        self.inflight = inflight or (lambda: self.held)
        self.poll_s = poll_s
        self.draining = False
        self.expired = asyncio.Event()
        self.task: asyncio.Task[None] | None = None  # the SIGTERM drain, once started
        self.on_start: Callable[[], object] | None = None  # called as a drain begins

    async def run(self, timeout_s: float, wind_down_s: float = 5.0) -> int:
        """Drain; the number of in-flight requests that had to be stopped."""
        self.draining = True
        if self.on_start is not None:
            self.on_start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.inflight() and loop.time() < deadline:
            await asyncio.sleep(self.poll_s)
        left = self.inflight()
        if left:
            self.expired.set()
            # the stopped requests send their error and release what they hold
            deadline = loop.time() + wind_down_s
            while self.inflight() and loop.time() < deadline:
                await asyncio.sleep(self.poll_s)
        return left

    async def race(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None (``work`` cancelled) when the grace period runs out."""
        return await _unless(work, self.expired.wait())


def drain_on_sigterm(drain: Drain, timeout_s: float, log: logging.Logger) -> None:
    """Make SIGTERM drain (``drain.run``) before uvicorn stops. Call from the app's lifespan
    startup, where uvicorn has installed its own handler: ours replaces it and, once drained,
    asks the uvicorn server to exit (which then finds no request left to wait for). Exiting this
    way is a clean exit (code 0), not a re-raised SIGTERM. No-op off the main thread (an app
    served by a test's thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    uvicorn_exit = signal.getsignal(signal.SIGTERM)
    server = getattr(uvicorn_exit, "__self__", None)  # uvicorn's Server.handle_exit

    async def finish() -> None:
        left = await drain.run(timeout_s)
        if left:
            log.warning(
                "shutdown: %d request(s) still running after %.0fs stopped", left, timeout_s
            )
        log.info("drained: exiting")
        if server is not None and hasattr(server, "should_exit"):
            server.should_exit = True
        elif callable(uvicorn_exit):
            uvicorn_exit(signal.SIGTERM, None)
        else:
            raise SystemExit(0)

    def start() -> None:
        if drain.task is None:  # a drain asked over HTTP does not stop the exit
            log.info("SIGTERM: draining (up to %.0fs for in-flight requests)", timeout_s)
            drain.task = loop.create_task(finish())

    signal.signal(signal.SIGTERM, lambda sig, frame: loop.call_soon_threadsafe(start))
