"""The gateway's HTTP/1.1 client for engine calls, against real sockets on 127.0.0.1: a raw
asyncio server writes exactly the bytes each case needs (keep-alive, chunked, broken off, closed
while idle, silent). Each case runs on asyncio's loop and on uvloop's (the gateway's, under
uvicorn)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvloop

from dsv4_common.process import free_port
from dsv4_serving.gateway.upstream import UpstreamClient, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
JSON = [("content-type", "application/json")]


def on_both_loops(
    test: Callable[[], Coroutine[Any, Any, None]],
) -> Callable[[str], None]:
    def run(loop: str) -> None:
        factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(test())

    run.__name__ = run.__qualname__ = test.__name__
    return pytest.mark.parametrize("loop", ["asyncio", "uvloop"])(run)  # type: ignore[no-any-return]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head, await reader.readexactly(length)


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on 127.0.0.1 running ``handler`` per connection; yields its URL and a list that
    counts the connections accepted."""
    accepted: list[int] = []

    async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(r, w)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    port = free_port()
    srv = await asyncio.start_server(on_connect, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        srv.close()


def answer(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


async def echo_forever(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        head, body = await read_request(r)
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        w.write(answer(b'{"echo": ' + body + b"}"))
        await w.drain()


@on_both_loops
async def test_answers_are_read_whole_and_connections_kept_alive() -> None:
    async with server(echo_forever) as (url, accepted):
        client = UpstreamClient(connect_timeout_s=2)
        for i in range(3):
            resp = await client.post(url, "/v1/completions", b"%d" % i, JSON)
            assert (resp.status, resp.headers.get("Content-Type")) == (200, "application/json")
            assert await resp.read() == b'{"echo": %d}' % i
            resp.close()
        assert len(accepted) == 1  # one connection, reused
        await client.close()


@on_both_loops
async def test_a_streamed_answer_comes_chunk_by_chunk() -> None:
    release = asyncio.Event()

    async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        w.write(b"7\r\ndata: a\r\n")
        await w.drain()
        await release.wait()  # the first chunk must reach the client before the second is sent
        w.write(b"7\r\ndata: b\r\n0\r\n\r\n")
        await w.drain()
        await r.read()

    async with server(chunked) as (url, _):
        client = UpstreamClient(connect_timeout_s=2)
        resp = await client.post(url, "/v1/completions", b"{}", JSON)
        got = []
        async for chunk in resp.iter_chunks(idle_timeout_s=5):
            got.append(chunk)
            release.set()
        assert got == [b"data: a", b"data: b"]
        resp.close()
        await client.close()


@on_both_loops
async def test_an_answer_broken_off_is_an_error_and_closing_early_drops_the_connection() -> None:
    seen_eof = asyncio.Event()

    async def half(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await w.drain()
        if (await r.read()) == b"":
            seen_eof.set()

    async with server(half) as (url, _):
        client = UpstreamClient(connect_timeout_s=2)
        resp = await client.post(url, "/v1/completions", b"{}", JSON)
        chunks = resp.iter_chunks(idle_timeout_s=5)
        assert await anext(chunks) == b"partial"
        resp.close()  # before the end: the engine must see the connection go
        await asyncio.wait_for(seen_eof.wait(), 5)
        await client.close()

    async def cut(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await w.drain()  # then the handler returns: the connection closes mid-body

    async with server(cut) as (url, _):
        client = UpstreamClient(connect_timeout_s=2)
        resp = await client.post(url, "/v1/completions", b"{}", JSON)
        with pytest.raises(UpstreamError, match="before the answer's end"):
            await resp.read(idle_timeout_s=5)
        resp.close()
        await client.close()


@on_both_loops
async def test_a_kept_alive_connection_the_engine_closed_is_replaced() -> None:
    async def once(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(answer(b"{}"))  # keep-alive by HTTP/1.1's default, then closed anyway
        await w.drain()

    async with server(once) as (url, accepted):
        client = UpstreamClient(connect_timeout_s=2)
        for _ in range(2):
            resp = await client.post(url, "/v1/completions", b"{}", JSON)
            assert await resp.read() == b"{}"
            resp.close()
            await asyncio.sleep(0.05)  # the server's close reaches the pooled connection
        assert len(accepted) == 2
        await client.close()


@on_both_loops
async def test_a_body_delimited_by_the_connections_end() -> None:
    async def http10(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b'HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{"a": 1}')
        await w.drain()

    async with server(http10) as (url, _):
        client = UpstreamClient(connect_timeout_s=2)
        resp = await client.post(url, "/v1/completions", b"{}", JSON)
        assert await resp.read(idle_timeout_s=5) == b'{"a": 1}'
        resp.close()
        await client.close()


@on_both_loops
async def test_unreachable_and_silent_engines() -> None:
    client = UpstreamClient(connect_timeout_s=2)
    with pytest.raises(UpstreamError, match="cannot connect"):
        await client.post(f"http://127.0.0.1:{free_port()}", "/v1/completions", b"{}", JSON)

    async def silent_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await w.drain()
        await r.read()

    async with server(silent_body) as (url, _):
        resp = await client.post(url, "/v1/completions", b"{}", JSON)
        with pytest.raises(TimeoutError):
            await resp.read(idle_timeout_s=0.2)
        resp.close()
    await client.close()


@on_both_loops
async def test_an_answer_over_the_pause_threshold_comes_whole_read_or_streamed() -> None:
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB: reading pauses at 1 MiB buffered

    async def large(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(r)
            w.write(answer(big))
            await w.drain()

    async with server(large) as (url, accepted):
        client = UpstreamClient(connect_timeout_s=2)
        resp = await client.post(url, "/v1/completions", b"{}", JSON)
        assert await resp.read(idle_timeout_s=5) == big
        resp.close()
        resp = await client.post(url, "/v1/completions", b"{}", JSON)
        got = b""
        async for chunk in resp.iter_chunks(idle_timeout_s=5):
            got += chunk
            await asyncio.sleep(0.001)  # a slow client: the engine's bytes wait in the socket
        assert got == big
        resp.close()
        assert len(accepted) == 1
        await client.close()
