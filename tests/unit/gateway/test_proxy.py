"""``Proxy``, the PD orchestration, against fake engines over real HTTP: which instance is
chosen, which failures are retried where, and that every attempt gives its load back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.health import check_once
from dsv4_serving.gateway.instances import InstancePool, Role
from dsv4_serving.gateway.lifecycle import Admission
from dsv4_serving.gateway.metrics import GatewayMetrics
from dsv4_serving.gateway.policies import PolicyName, RouteRequest, make_policy
from dsv4_serving.gateway.proxy import Proxy, RelayResponse, UpstreamFailed
from tests.unit.gateway.fake_engine import CHUNK, STREAM, WHOLE, FakeEngine, Mode, engines

PATH = "/v1/completions"
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}
REQ = RouteRequest(prompt_tokens=100)


@asynccontextmanager
async def proxy_over(
    role: Role, *modes: Mode, policy: PolicyName = "round_robin", dp_size: int = 1
) -> AsyncIterator[tuple[Proxy, list[FakeEngine]]]:
    """A Proxy whose pool is fake engines of ``role``, in ``modes`` order; on the way out, it
    checks that no instance is left holding load."""
    fakes = await engines(*modes)
    pool = InstancePool()
    pool.set_members(role, [f.url for f in fakes], dp_size=dp_size)
    cfg = GatewayConfig(both_urls=["http://unused:1"], retries=1)
    proxy = Proxy(cfg, pool, make_policy(policy), GatewayMetrics())
    try:
        async with aiohttp.ClientSession() as proxy.client:
            yield proxy, fakes
        for inst in pool.all():
            assert [(r.inflight_requests, r.inflight_tokens) for r in inst.ranks] == [
                (0, 0)
            ] * dp_size, inst.url
    finally:
        await proxy.upstream.close()
        for f in fakes:
            await f.stop()


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def _retries(proxy: Proxy, stage: str) -> float:
    return (
        proxy.metrics.registry.get_sample_value("dsv4_gateway_retries_total", {"stage": stage})
        or 0.0
    )


def _failures(proxy: Proxy) -> list[int]:
    return [i.failures for i in proxy.pool.all()]


async def _forward(proxy: Proxy, role: Role, stream: bool) -> tuple[int, str]:
    """Status and whole body of a forwarded request, the ticket closed afterwards."""
    with Admission(8, proxy.metrics).admit() as ticket:
        resp = await proxy.forward(
            role, PATH, {**BODY, "stream": stream}, REQ, "rid-1", stream, ticket
        )
        if isinstance(resp, RelayResponse):
            text = b"".join([c async for c in resp.body_iterator]).decode()  # type: ignore[misc]
        else:
            text = bytes(resp.body).decode()
        return resp.status_code, text


def test_prefill_goes_to_the_instance_that_holds_the_prompt_prefix() -> None:
    async def test() -> None:
        async with proxy_over("prefill", "ok", "ok", policy="dplb") as (proxy, fakes):
            hashes = block_hashes(list(range(64)), 16)
            proxy.pool.of_role("prefill")[1].prefix.add(hashes)
            req = RouteRequest(prompt_tokens=70, block_hashes=hashes, block_size=16)
            answer, inst = await proxy.prefill(PATH, BODY, req, "rid-1")
            assert inst.url == fakes[1].url and [f.calls for f in fakes] == [0, 1]
            assert answer["kv_transfer_params"] == {"do_remote_prefill": True, "remote_host": "x"}
            sent = fakes[1].bodies[0]
            assert sent["max_tokens"] == 1 and sent["stream"] is False
            assert sent["kv_transfer_params"]["do_remote_decode"] is True
            assert fakes[1].headers[0]["x-request-id"] == "rid-1"

    run(test)


def test_a_failed_prefill_is_retried_on_another_prefill_instance() -> None:
    async def test() -> None:
        async with proxy_over("prefill", "fail", "ok") as (proxy, fakes):
            _, inst = await proxy.prefill(PATH, BODY, REQ, "rid-1")
            assert inst.url == fakes[1].url and [f.calls for f in fakes] == [1, 1]
            assert _failures(proxy) == [1, 0] and _retries(proxy, "prefill") == 1

    run(test)


def test_a_prefill_4xx_goes_back_to_the_client_without_a_retry() -> None:
    async def test() -> None:
        async with proxy_over("prefill", "bad_request", "ok") as (proxy, fakes):
            with pytest.raises(UpstreamFailed) as failed:
                await proxy.prefill(PATH, BODY, REQ, "rid-1")
            assert failed.value.response.status_code == 400
            assert [f.calls for f in fakes] == [1, 0] and _failures(proxy) == [0, 0]

    run(test)


def test_prefill_failing_everywhere_is_502_and_with_nobody_healthy_503() -> None:
    async def test() -> None:
        async with proxy_over("prefill", "fail", "fail") as (proxy, fakes):
            with pytest.raises(UpstreamFailed) as failed:
                await proxy.prefill(PATH, BODY, REQ, "rid-1")
            err: dict[str, Any] = json.loads(bytes(failed.value.response.body))["error"]
            assert failed.value.response.status_code == 502
            assert err["code"] == "upstream_error" and err["type"] == "server_error"
            assert "answered 500" in err["message"]
            for inst in proxy.pool.all():
                inst.healthy = False
            with pytest.raises(UpstreamFailed) as failed:
                await proxy.prefill(PATH, BODY, REQ, "rid-2")
            assert failed.value.response.status_code == 503
            assert [f.calls for f in fakes] == [1, 1]  # nobody was tried the second time

    run(test)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_failing_before_its_first_byte_is_retried_on_another_decode(stream: bool) -> None:
    async def test() -> None:
        async with proxy_over("decode", "fail", "ok") as (proxy, fakes):
            status, text = await _forward(proxy, "decode", stream)
            assert status == 200 and (text == STREAM if stream else json.loads(text) == WHOLE)
            assert [f.calls for f in fakes] == [1, 1]
            assert _failures(proxy) == [1, 0] and _retries(proxy, "decode") == 1

    run(test)


def test_a_kv_transfer_error_is_retried_elsewhere_and_not_held_against_the_engine() -> None:
    async def test() -> None:
        async with proxy_over("decode", "kv_error", "ok") as (proxy, fakes):
            status, _ = await _forward(proxy, "decode", stream=True)
            assert status == 200 and [f.calls for f in fakes] == [1, 1]
            assert _failures(proxy) == [0, 0]  # the prefill side's export is usually at fault

    run(test)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_draining_engine_is_set_aside_and_the_request_goes_elsewhere(role: Role) -> None:
    async def test() -> None:
        async with proxy_over(role, "draining", "ok") as (proxy, fakes):
            if role == "prefill":
                _, inst = await proxy.prefill(PATH, BODY, REQ, "rid-1")
                assert inst.url == fakes[1].url
            else:
                status, text = await _forward(proxy, "decode", stream=True)
                assert (status, text) == (200, STREAM)
            assert [f.calls for f in fakes] == [1, 1]
            assert _failures(proxy) == [0, 0]  # shutting down is not failing
            draining = [i.draining for i in sorted(proxy.pool.all(), key=lambda i: i.url)]
            assert draining == [True, False]
            assert [i.url for i in proxy.pool.of_role(role)] == [fakes[1].url]
            # no new request goes to it, even round-robin's turn
            await _forward(proxy, role, stream=False)
            assert [f.calls for f in fakes] == [1, 2]

    run(test)


def test_a_drained_engine_back_on_its_address_is_readmitted_by_the_health_check() -> None:
    async def test() -> None:
        async with proxy_over("decode", "draining", "ok") as (proxy, fakes):
            await _forward(proxy, "decode", stream=False)
            inst = proxy.pool.get(fakes[0].url)
            assert inst is not None and inst.draining
            assert proxy.client is not None
            await check_once(proxy.client, inst, proxy.metrics, 2)
            assert inst.draining  # /ready still 503
            fakes[0].mode = "ok"  # restarted
            await check_once(proxy.client, inst, proxy.metrics, 2)
            assert not inst.draining and inst in proxy.pool.of_role("decode")

    run(test)


def test_a_decode_broken_after_its_first_byte_is_not_retried() -> None:
    async def test() -> None:
        async with proxy_over("decode", "break", "ok") as (proxy, fakes):
            status, text = await _forward(proxy, "decode", stream=True)
            assert status == 200 and text.startswith(CHUNK)
            events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
            assert events[-1] == "[DONE]" and "upstream_error" in events[-2]
            assert [f.calls for f in fakes] == [1, 0] and _failures(proxy) == [1, 0]

    run(test)


def test_a_streamed_answer_holds_its_instance_load_until_the_ticket_closes() -> None:
    async def test() -> None:
        async with proxy_over("decode", "ok") as (proxy, _):
            inst = proxy.pool.all()[0]
            with Admission(8, proxy.metrics).admit() as ticket:
                resp = await proxy.forward("decode", PATH, BODY, REQ, "rid-1", True, ticket)
                assert isinstance(resp, RelayResponse)
                assert (inst.ranks[0].inflight_requests, inst.ranks[0].inflight_tokens) == (1, 100)
            assert inst.ranks[0].inflight_requests == 0  # never iterated, still released

    run(test)


def test_the_data_parallel_rank_is_sent_to_a_multi_rank_instance() -> None:
    async def test() -> None:
        async with proxy_over("decode", "ok", dp_size=2) as (proxy, fakes):
            await _forward(proxy, "decode", stream=False)
            await _forward(proxy, "decode", stream=False)
            assert [h["x-data-parallel-rank"] for h in fakes[0].headers] == ["0", "1"]

    run(test)
