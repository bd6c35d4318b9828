"""A request's lifecycle through the gateway app, against fake engines over real HTTP: however a
request ends, its in-flight slot, its instance load and its connection are released exactly
once, it is counted once under the right status, and only a success records an E2E latency."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from dsv4_serving.gateway.app import Gateway
from dsv4_serving.gateway.config import GatewayConfig
from tests.unit.gateway.fake_engine import STREAM, WHOLE, FakeEngine, Mode, engines
from tests.unit.gateway.serving import serving, until

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}
Scenario = Callable[[httpx.AsyncClient, str, list[FakeEngine]], Awaitable[None]]


def _sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


def _outcomes(gw: Gateway) -> dict[str, float]:
    statuses = ("ok", "error", "cancelled", "rejected")
    counts = {s: _sample(gw, "dsv4_gateway_requests_total", status=s) for s in statuses}
    return {s: n for s, n in counts.items() if n}


def _released(gw: Gateway) -> bool:
    return gw.admission.inflight == 0 and all(
        r.inflight_requests == 0 and r.inflight_tokens == 0 for i in gw.pool.all() for r in i.ranks
    )


def _run(modes: tuple[Mode, ...], scenario: Scenario, **cfg: Any) -> Gateway:
    """Serve a gateway over engines in ``modes`` (both-role), run ``scenario``, and return the
    gateway once everything it held is released."""

    async def main() -> Gateway:
        fakes = await engines(*modes)
        config = GatewayConfig(both_urls=[f.url for f in fakes], policy="round_robin", **cfg)
        try:
            async with serving(config) as (url, gw), httpx.AsyncClient(timeout=10) as client:
                await scenario(client, url, fakes)
                await until(lambda: _released(gw) and bool(_outcomes(gw)))
                assert gw.metrics.inflight._value.get() == 0  # the gauge follows the count
                return gw
        finally:
            for f in fakes:
                await f.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_success_is_counted_ok_once_with_one_e2e_latency(stream: bool) -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        r = await client.post(f"{url}/v1/completions", json={**BODY, "stream": stream})
        assert r.status_code == 200
        assert (r.text == STREAM) if stream else (r.json() == WHOLE)

    gw = _run(("ok",), scenario)
    assert _outcomes(gw) == {"ok": 1}
    assert _sample(gw, "vllm:e2e_request_latency_seconds_count") == 1
    assert _sample(gw, "vllm:time_to_first_token_seconds_count") == (1 if stream else 0)


def test_an_upstream_error_on_every_instance_is_one_error_and_no_latency() -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        r = await client.post(f"{url}/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_error"
        assert [f.calls for f in fakes] == [1, 1]  # tried once on each

    gw = _run(("fail", "fail"), scenario)
    assert _outcomes(gw) == {"error": 1}
    assert _sample(gw, "vllm:e2e_request_latency_seconds_count") == 0


def test_a_retried_request_is_counted_once() -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        r = await client.post(f"{url}/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 200 and r.text == STREAM
        assert [f.calls for f in fakes] == [1, 1]

    gw = _run(("fail", "ok"), scenario)
    assert _outcomes(gw) == {"ok": 1}
    assert _sample(gw, "dsv4_gateway_retries_total", stage="both") == 1
    assert _sample(gw, "vllm:e2e_request_latency_seconds_count") == 1


def test_a_client_gone_before_the_answer_cancels_the_upstream_call() -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        call = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
        await until(lambda: fakes[0].calls == 1)
        call.cancel()  # the client hangs up while the engine is still working
        await until(lambda: fakes[0].hung_up == 1)

    gw = _run(("hang",), scenario)
    assert _outcomes(gw) == {"cancelled": 1}


def test_a_client_gone_mid_stream_closes_the_upstream_stream() -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        body = {**BODY, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                assert line.startswith("data: ")
                break  # one chunk, then the client leaves
        await until(lambda: fakes[0].hung_up == 1)

    gw = _run(("slow",), scenario)
    assert _outcomes(gw) == {"cancelled": 1}
    assert _sample(gw, "vllm:e2e_request_latency_seconds_count") == 0


def test_an_upstream_broken_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        r = await client.post(f"{url}/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 200  # the client already had its 200
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "upstream_error"
        assert fakes[0].calls == 1  # never retried after the first byte

    gw = _run(("break", "ok"), scenario)
    assert _outcomes(gw) == {"error": 1}


def test_beyond_the_inflight_limit_a_request_is_rejected_and_holds_nothing() -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        first = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
        await until(lambda: fakes[0].calls == 1)
        r = await client.post(f"{url}/v1/completions", json=BODY)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": "gateway is at its limit of 1 requests in flight; retry later",
            "type": "rate_limit_error",
            "param": None,
            "code": "too_many_requests",
        }
        first.cancel()
        await until(lambda: fakes[0].hung_up == 1)

    gw = _run(("hang",), scenario, max_inflight=1)
    assert _outcomes(gw) == {"rejected": 1, "cancelled": 1}


def test_an_engine_4xx_passes_through_and_counts_as_an_error() -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        r = await client.post(f"{url}/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["message"] == "temperature must be >= 0"
        assert fakes[0].calls == 1  # the request is bad, not the engine: no retry

    gw = _run(("bad_request", "ok"), scenario)
    assert _outcomes(gw) == {"error": 1}


def test_bad_json_is_rejected_before_admission() -> None:
    async def scenario(client: httpx.AsyncClient, url: str, fakes: list[FakeEngine]) -> None:
        r = await client.post(f"{url}/v1/completions", content=b"{nope")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert r.json()["error"]["type"] == "invalid_request_error"
        ok = await client.post(f"{url}/v1/completions", json=BODY)
        assert ok.status_code == 200

    gw = _run(("ok",), scenario)
    assert _outcomes(gw) == {"ok": 1}
