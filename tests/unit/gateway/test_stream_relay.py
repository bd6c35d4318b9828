"""``StreamRelay`` (``gateway/proxy.py``) against fake engines over real HTTP that write stream
state: a stream whose engine dies mid-answer is continued on another from what the client has,
the failed attempt gives its load back, and with nobody left the stream ends with an error."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.instances import InstancePool
from dsv4_serving.gateway.lifecycle import Admission
from dsv4_serving.gateway.metrics import GatewayMetrics
from dsv4_serving.gateway.policies import RouteRequest, make_policy
from dsv4_serving.gateway.proxy import Proxy, RelayResponse
from dsv4_serving.gateway.stream_state import with_state

TOKENS = 6
BODY = with_state({"model": "m", "prompt": "p", "max_tokens": TOKENS, "stream": True})


class StateEngine:
    """Streams token ``k`` as text ``t<k>`` with its state block, from where ``continuation``
    says the client is; ``dies_after`` tokens into an answer, it drops the connection."""

    def __init__(self, dies_after: int | None) -> None:
        self.dies_after = dies_after
        self.pause = 0.0  # between tokens, so that each comes in its own read
        self.bodies: list[dict[str, Any]] = []
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def start(self) -> StateEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        cont = body["continuation"]
        done = len(cont.get("token_ids", []))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if not done:
            await resp.write(b': dsv4 {"t":[],"c":0,"id":"cmpl-7","created":5}\n\n')
        chars = cont.get("chars", 0)
        for k in range(done, TOKENS):
            if self.dies_after is not None and k - done == self.dies_after:
                await resp.write(b'data: {"half": ')  # a half-sent event, then death
                await asyncio.sleep(0.05)
                assert request.transport is not None
                request.transport.close()
                return resp
            await asyncio.sleep(self.pause)
            text = f"t{k}"
            chars += len(text)
            chunk = {"id": cont.get("id", "cmpl-7"), "choices": [{"text": text}]}
            state = {"t": [k], "c": chars} | ({"f": 1} if k == TOKENS - 1 else {})
            await resp.write(
                f"data: {json.dumps(chunk)}\n\n: dsv4 {json.dumps(state)}\n\n".encode()
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _read(resp: RelayResponse, leave_at: bytes | None) -> str:
    """The client's read, closing the request's ticket as ``RelayResponse`` does;
    ``leave_at``: the client hangs up once it has these bytes (its task cancelled there, as
    Starlette's is on a disconnect), before the upstream's end."""
    got: list[bytes] = []
    chunks = resp.body_iterator
    try:
        with resp._closer:
            async for chunk in chunks:
                got.append(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
                if leave_at is not None and leave_at in got[-1]:
                    raise asyncio.CancelledError
    except asyncio.CancelledError:
        await chunks.aclose()  # type: ignore[attr-defined]
    return b"".join(got).decode()


async def _relay(
    *dies_after: int | None, leave_at: bytes | None = None, pause: float = 0.0
) -> tuple[str, Proxy, list[StateEngine]]:
    fakes = sorted([await StateEngine(d).start() for d in dies_after], key=lambda f: f.url)
    for f, d in zip(fakes, dies_after, strict=True):  # the first by URL dies first
        f.dies_after, f.pause = d, pause
    pool = InstancePool()
    pool.set_members("both", [f.url for f in fakes])
    proxy = Proxy(
        GatewayConfig(both_urls=["http://unused:1"]),
        pool,
        make_policy("round_robin"),
        GatewayMetrics(),
    )
    try:
        with Admission(8, proxy.metrics).admit() as ticket:
            resp = await proxy.forward(
                "both",
                "/v1/completions",
                BODY,
                RouteRequest(prompt_tokens=10),
                "rid-9",
                True,
                ticket,
            )
            assert isinstance(resp, RelayResponse)
            resp.take_over()  # as the app does: the stream ends the request
        text = await _read(resp, leave_at)
        for inst in pool.all():
            assert inst.ranks[0].inflight_requests == 0, inst.url
        return text, proxy, fakes
    finally:
        await proxy.upstream.close()
        for f in fakes:
            assert f.runner is not None
            await f.runner.cleanup()


def _migrations(proxy: Proxy, outcome: str) -> float:
    labels = {"reason": "broken", "outcome": outcome}
    value = proxy.metrics.registry.get_sample_value("dsv4_gateway_stream_migrations_total", labels)
    return value or 0.0


def _uninterrupted() -> str:
    chunks = [
        f"data: {json.dumps({'id': 'cmpl-7', 'choices': [{'text': f't{k}'}]})}\n\n"
        for k in range(TOKENS)
    ]
    return "".join(chunks) + "data: [DONE]\n\n"


def test_a_stream_broken_mid_answer_is_continued_on_another_engine() -> None:
    text, proxy, (_, other) = asyncio.run(_relay(2, None))
    assert text == _uninterrupted()
    assert other.bodies[0]["continuation"] == {
        "token_ids": [0, 1],
        "chars": 4,
        "id": "cmpl-7",
        "created": 5,
    }
    assert {k: v for k, v in other.bodies[0].items() if k != "continuation"} == {
        k: v for k, v in BODY.items() if k != "continuation"
    }
    assert _migrations(proxy, "continued") == 1
    assert [i.failures for i in sorted(proxy.pool.all(), key=lambda i: i.url)] == [1, 0]


def test_with_nobody_left_the_stream_ends_with_an_error_event() -> None:
    text, proxy, _ = asyncio.run(_relay(2, 1))
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[:3] == _uninterrupted().split("\n\n")[:3]  # t0, t1; t2 from the second
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "continuing it failed" in err["message"]
    assert events[-1] == "data: [DONE]"
    assert _migrations(proxy, "continued") == 1 and _migrations(proxy, "failed") == 1


def _requests(proxy: Proxy, status: str) -> float:
    value = proxy.metrics.registry.get_sample_value(
        "dsv4_gateway_requests_total", {"status": status}
    )
    return value or 0.0


def test_a_client_that_leaves_once_it_has_done_counts_as_ok() -> None:
    # clients close at [DONE], before the upstream's own end (a CI failure counted them
    # cancelled)
    text, proxy, _ = asyncio.run(_relay(None, leave_at=b"[DONE]"))
    assert text == _uninterrupted()
    assert _requests(proxy, "ok") == 1 and _requests(proxy, "cancelled") == 0


def test_a_client_that_leaves_mid_stream_counts_as_cancelled() -> None:
    text, proxy, _ = asyncio.run(_relay(None, leave_at=b'"t1"', pause=0.05))
    assert text == "".join(e + "\n\n" for e in _uninterrupted().split("\n\n")[:2])
    assert _requests(proxy, "cancelled") == 1 and _requests(proxy, "ok") == 0
