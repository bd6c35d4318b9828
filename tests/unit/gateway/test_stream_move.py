"""A drained stream (``gateway/proxy.py`` ``StreamRelay``, ``gateway/stream_state.py``) against
fake engines over real HTTP: the engine ends the stream with a migrate block carrying its KV's
``kv_transfer_params``; the gateway continues it on another engine with those params and the
tokens the client has, the drained engine is set aside (no failure counted), and the client's
stream is the uninterrupted one. A migrate block without params is continued by recompute."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from dsv4_serving.gateway.stream_state import StreamState
from tests.unit.gateway import test_stream_relay as relay
from tests.unit.gateway.test_stream_relay import TOKENS, StateEngine, _uninterrupted

KV = {"remote_transfer_id": "x1", "remote_num_tokens": 12}


class MovingEngine(StateEngine):
    """``dies_after`` tokens into an answer, a drain moves it: a migrate block, a clean end."""

    def __init__(self, dies_after: int | None, kv: dict[str, Any] | None = KV) -> None:
        super().__init__(dies_after)
        self.kv = kv

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
                moved = {"t": [], "c": chars, "m": {"kv_transfer_params": self.kv, "tokens": 12}}
                await resp.write(f": dsv4 {json.dumps(moved)}\n\n".encode())
                await resp.write_eof()
                return resp
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


def _run(kv: dict[str, Any] | None) -> tuple[str, Any, list[StateEngine]]:
    engine = relay.StateEngine
    relay.StateEngine = lambda d: MovingEngine(d, kv)  # type: ignore[assignment,misc]
    try:
        return asyncio.run(relay._relay(3, None))
    finally:
        relay.StateEngine = engine  # type: ignore[misc]


def _moves(proxy: Any, outcome: str) -> float:
    labels = {"reason": "drain", "outcome": outcome}
    value = proxy.metrics.registry.get_sample_value("dsv4_gateway_stream_migrations_total", labels)
    return value or 0.0


def test_a_drained_stream_continues_with_its_kv_on_another_engine() -> None:
    text, proxy, (_, other) = _run(KV)
    assert text == _uninterrupted()
    body = other.bodies[0]
    assert body["kv_transfer_params"] == KV
    assert body["continuation"] == {
        "token_ids": [0, 1, 2],
        "chars": 6,
        "id": "cmpl-7",
        "created": 5,
    }
    assert _moves(proxy, "continued") == 1
    insts = sorted(proxy.pool.all(), key=lambda i: i.url)
    assert [i.failures for i in insts] == [0, 0]  # a drain is not a failure ...
    assert insts[0].draining and not insts[1].draining  # ... but no new requests go there


def test_a_drained_stream_without_its_kv_is_recomputed() -> None:
    text, proxy, (_, other) = _run(None)
    assert text == _uninterrupted()
    assert "kv_transfer_params" not in other.bodies[0]
    assert _moves(proxy, "continued") == 1


def test_the_migrate_block_is_state_not_output() -> None:
    st = StreamState()
    out = st.feed(
        b': dsv4 {"t":[],"c":0,"id":"a","created":1}\n\ndata: {"x":1}\n\n: dsv4 {"t":[4],"c":2}\n\n'
    )
    assert out == b'data: {"x":1}\n\n'
    assert (
        st.feed(b': dsv4 {"t":[],"c":2,"m":{"kv_transfer_params":{"k":1},"tokens":1}}\n\n') == b""
    )
    assert st.moved == {"kv_transfer_params": {"k": 1}, "tokens": 1} and st.token_ids == [4]
    assert st.continuable()
