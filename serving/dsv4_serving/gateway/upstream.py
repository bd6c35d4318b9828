"""The gateway's HTTP/1.1 client for its calls to engines (prefill, decode): keep-alive
connections per engine, responses parsed by httptools (what uvicorn parses requests with).

aiohttp's client cost about 40% of the gateway's CPU per PD request (two upstream calls each),
and that CPU is the gateway's throughput; this client does only what those calls need: one
POST per connection at a time, the answer read whole or relayed chunk by chunk, connect, total
and idle-read timeouts, and ``close`` before the end drops the connection (the engine sees the
disconnect and aborts the request). Health checks and scrapes keep using aiohttp (a few calls
per second).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import cast
from urllib.parse import urlsplit

import httptools

_IDLE_S = 4.0  # reuse a kept-alive connection only this long (uvicorn closes them after 5 s)
_POOL_PER_HOST = 256
_PAUSE_AT = 1 << 20  # stop reading from the engine while this much is buffered, unrelayed


class UpstreamError(Exception):
    """The engine could not be reached, or its connection broke off before the answer's end."""


class Headers:
    """A response's headers: ``get`` by name (any case), ``items`` in the order received;
    decoded only when asked (a prefill answer's never are, unless it failed)."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self._by_name: dict[str, str] | None = None

    def get(self, name: str, default: str | None = None) -> str | None:
        if self._by_name is None:
            self._by_name = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.raw}
        return self._by_name.get(name.lower(), default)

    def items(self) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw]


class _Connection(asyncio.Protocol):
    """One connection to one engine; carries one response at a time."""

    def __init__(self, pool: UpstreamClient, key: tuple[str, int, bool]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.response: UpstreamResponse | None = None
        self.parser = httptools.HttpResponseParser(self)
        self._header_pairs: list[tuple[bytes, bytes]] = []
        self._headers_done: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._broken(f"unparsable response: {e}")
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.response
        if resp is not None and not resp.complete:
            if resp.status and resp.until_eof():  # a body delimited by the connection's end
                resp.complete = True
                resp.wake()
            else:
                self._broken(f"connection closed before the answer's end ({exc or 'EOF'})")

    def pause_writing(self) -> None:  # requests are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # ---- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_pairs.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is None:
            return
        resp.status = self.parser.get_status_code()
        resp.headers = Headers(self._header_pairs)
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None:
            resp.chunks.append(body)
            resp.buffered += len(body)
            if resp.buffered > _PAUSE_AT and self.transport is not None:
                self.transport.pause_reading()
            resp.wake()

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp.complete = True
            resp.keep_alive = self.parser.should_keep_alive()
            resp.wake()

    # ---- used by the client and the response ---------------------------------------------

    def _broken(self, why: str) -> None:
        resp = self.response
        if resp is None:
            return
        resp.error = UpstreamError(why)
        if self._headers_done is not None and not self._headers_done.done():
            self._headers_done.set_exception(resp.error)
        resp.wake()

    async def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        assert self.transport is not None
        self.response = UpstreamResponse(self)
        self._header_pairs = []
        self._headers_done = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        await self._headers_done
        return self.response

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def done_with(self, resp: UpstreamResponse) -> None:
        """The response is finished with: keep the connection if it was read to its end."""
        self.response = None
        if resp.complete and resp.keep_alive and resp.error is None and not self.closed:
            if self.transport is not None and self.transport.is_reading() is False:
                self.transport.resume_reading()
            self.pool.put_back(self)
        else:
            self.abort()


class UpstreamResponse:
    """An engine's answer: ``status`` and ``headers`` at once, the body by ``read`` or
    ``iter_chunks``; ``close`` (always called, also on error) ends it."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers = Headers([])
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def until_eof(self) -> bool:
        """Whether the body ends with the connection (neither a length nor chunked)."""
        h = self.headers
        return h.get("content-length") is None and h.get("transfer-encoding") is None

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _more(self, idle_timeout_s: float | None) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            if idle_timeout_s is None:
                await self._waiter
            else:
                async with asyncio.timeout(idle_timeout_s):
                    await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks.clear()
        if self.buffered > _PAUSE_AT and self._conn.transport is not None:
            self._conn.transport.resume_reading()
        self.buffered = 0
        return data

    async def iter_chunks(self, idle_timeout_s: float | None = None) -> AsyncIterator[bytes]:
        """The body as it arrives; UpstreamError if the connection breaks off before its end,
        TimeoutError after ``idle_timeout_s`` without a byte."""
        while True:
            if self.chunks:
                yield self._take()
                continue
            if self.error is not None:
                raise self.error
            if self.complete:
                return
            await self._more(idle_timeout_s)

    async def read(self, idle_timeout_s: float | None = None) -> bytes:
        """The whole body (``iter_chunks``' errors), without an async generator per call: a
        small answer is usually all there with its headers."""
        parts: list[bytes] = []
        while True:
            if self.chunks:
                parts.append(self._take())  # taken as it comes: a paused read resumes
            if self.error is not None:
                raise self.error
            if self.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._more(idle_timeout_s)

    def close(self) -> None:
        """Release the connection: back to the pool if the answer was read to its end, else
        dropped (the engine sees the client go and aborts the request). Idempotent."""
        if not self._closed:
            self._closed = True
            self._conn.done_with(self)


class UpstreamClient:
    """Keep-alive connections to the engines, by (host, port, TLS)."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._parsed: dict[str, tuple[tuple[str, int, bool], bytes]] = {}

    def _target(self, base_url: str) -> tuple[tuple[str, int, bool], bytes]:
        """(host, port, tls) and the Host header of an engine's base URL, parsed once."""
        hit = self._parsed.get(base_url)
        if hit is None:
            u = urlsplit(base_url)
            tls = u.scheme == "https"
            host = u.hostname or "127.0.0.1"
            port = u.port or (443 if tls else 80)
            hit = self._parsed[base_url] = ((host, port, tls), (u.netloc or host).encode())
        return hit

    def put_back(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= _POOL_PER_HOST:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), host, port, ssl=self._ssl if tls else None
                )
        except OSError as e:
            raise UpstreamError(f"cannot connect to {host}:{port}: {e}") from None
        return conn

    def _reusable(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < _IDLE_S:
                return conn
            conn.abort()
        return None

    async def post(
        self, base_url: str, path: str, body: bytes, headers: Iterable[tuple[str, str]]
    ) -> UpstreamResponse:
        """POST ``body`` (JSON) and wait for the answer's headers. The caller bounds the wait
        (asyncio.timeout) and must ``close`` the response."""
        key, host = self._target(base_url)
        lines = [b"POST ", path.encode(), b" HTTP/1.1\r\nhost: ", host]
        lines.append(b"\r\ncontent-length: %d" % len(body))
        for k, v in headers:
            lines += (b"\r\n", k.encode("latin-1"), b": ", v.encode("latin-1"))
        lines.append(b"\r\n\r\n")
        head = b"".join(lines)
        conn = self._reusable(key)
        if conn is not None:
            try:
                return await conn.send(head, body)
            except UpstreamError:
                # the engine closed the kept-alive connection as this request went out: once
                # more on a new one (no answer came, so it took nothing on this one)
                conn.abort()
            except BaseException:
                conn.abort()
                raise
        conn = await self._connect(key)
        try:
            return await conn.send(head, body)
        except BaseException:
            conn.abort()
            raise

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
