"""The gateway app served by uvicorn in this process on 127.0.0.1, for tests that need real
HTTP between a client, the gateway and fake engines."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import uvicorn

from dsv4_serving.gateway.app import Gateway, create_app
from dsv4_serving.gateway.config import GatewayConfig


@asynccontextmanager
async def serving(cfg: GatewayConfig) -> AsyncIterator[tuple[str, Gateway]]:
    """(base URL, the Gateway object) while the app runs."""
    thresholds = gc.get_threshold()
    app = create_app(cfg)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}", app.state.gateway
    finally:
        server.should_exit = True
        await task
        sock.close()
        # the app's start-up tunes the collector for serving; give the test process its own back
        gc.unfreeze()
        gc.set_threshold(*thresholds)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for ``condition``: the server finishes a request just after the client has it all."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)
