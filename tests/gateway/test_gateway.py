"""The gateway in front of real engines: same tokens as the engine itself, load spread, failures,
bad input, limits and auth. PD orchestration through the gateway is in test_gateway_pd.py."""

from __future__ import annotations

import asyncio
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dsv4_common.process import Service, dsv4_argv
from tests.gateway.conftest import engine, gateway, routed_counts, running

PROMPTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "a",
    "0123456789" * 20,
]


@pytest.fixture(scope="module")
def gw(two_engines):  # type: ignore[no-untyped-def]
    a, b = two_engines
    with running(gateway("gateway", "--engine", a.url, "--engine", b.url)) as (g,):
        yield g


def _complete(url: str, prompt: str, max_tokens: int = 12, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    if not stream:
        r = client.completions.create(
            model="dsv4-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return r.choices[0].text
    parts = client.completions.create(
        model="dsv4-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(c.choices[0].text for c in parts if c.choices)


def test_same_tokens_through_the_gateway(gw: Service, two_engines) -> None:  # type: ignore[no-untyped-def]
    direct = two_engines[0]
    for prompt in PROMPTS:
        want = _complete(direct.url, prompt)
        assert _complete(gw.url, prompt) == want
        assert _complete(gw.url, prompt, stream=True) == want


def test_chat_streaming_through_the_gateway(gw: Service, two_engines) -> None:  # type: ignore[no-untyped-def]
    msgs: list[Any] = [{"role": "user", "content": "Say something."}]

    def chat(url: str, stream: bool) -> tuple[str, str]:
        """(reasoning, content): dsv4-tiny speaks V4's format and thinks by default."""
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        if stream:
            deltas = [
                ch.choices[0].delta
                for ch in c.chat.completions.create(
                    model="dsv4-tiny", messages=msgs, max_tokens=10, temperature=0, stream=True
                )
                if ch.choices
            ]
            return (
                "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                "".join(d.content or "" for d in deltas),
            )
        msg = (
            c.chat.completions.create(
                model="dsv4-tiny", messages=msgs, max_tokens=10, temperature=0
            )
            .choices[0]
            .message
        )
        return getattr(msg, "reasoning_content", None) or "", msg.content or ""

    want = chat(two_engines[0].url, False)
    assert "".join(want), "the engine answered nothing to compare"
    assert chat(gw.url, False) == want
    assert chat(gw.url, True) == want


def test_models_health_metrics(gw: Service) -> None:
    models = httpx.get(f"{gw.url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "dsv4-tiny"
    health = httpx.get(f"{gw.url}/health", timeout=10).json()
    assert health["healthy"]["both"] == 2
    metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert "vllm:e2e_request_latency_seconds_bucket" in metrics
    assert "dsv4_gateway_routed_total" in metrics


def test_equal_engines_share_the_load(two_engines) -> None:  # type: ignore[no-untyped-def]
    # "equal speed" by construction: two instance entries for the same engine process, so any
    # imbalance is the policy's, not the CPU scheduler's
    a, _ = two_engines
    twin = a.url.replace("127.0.0.1", "localhost")
    with running(gateway("gateway-share", "--engine", a.url, "--engine", twin)) as (g,):
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: _complete(g.url, f"request {i} " * 3, max_tokens=6), range(80)))
        counts = routed_counts(g)
        assert sum(counts.values()) == 80
        assert max(counts.values()) <= 1.2 * min(counts.values()), counts


def test_bad_input_gets_openai_errors(gw: Service) -> None:
    r = httpx.post(
        f"{gw.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{gw.url}/v1/completions", json=[1, 2], timeout=10)
    assert r.status_code == 400
    # the engine's own 400 (bad sampling value) passes through unchanged
    r = httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": "dsv4-tiny", "prompt": "x", "temperature": -1},
        timeout=30,
    )
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    assert r.headers["x-request-id"]


def test_request_id_is_propagated(gw: Service) -> None:
    r = httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": "dsv4-tiny", "prompt": "x", "max_tokens": 2},
        headers={"x-request-id": "abc-123"},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


def test_api_key_and_inflight_limit(two_engines, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, _ = two_engines
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    limited = gateway(
        "gateway-limited", "--engine", a.url, "--api-key-file", str(key), "--max-inflight", "1"
    )
    with running(limited) as (g,):
        body = {"model": "dsv4-tiny", "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{g.url}/v1/completions", json=body, timeout=30).status_code == 401
        ok = httpx.post(
            f"{g.url}/v1/completions",
            json=body,
            headers={"authorization": "Bearer s3cret"},
            timeout=30,
        )
        assert ok.status_code == 200

        async def two_at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(
                timeout=60, headers={"authorization": "Bearer s3cret"}
            ) as c:
                long = {**body, "max_tokens": 200, "ignore_eos": True}
                first = asyncio.create_task(c.post(f"{g.url}/v1/completions", json=long))
                await asyncio.sleep(0.5)
                second = await c.post(f"{g.url}/v1/completions", json=body)
                return [await first, second]

        first, second = asyncio.run(two_at_once())
        assert first.status_code == 200
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["type"] == "rate_limit_error"
        assert g.metric("dsv4_gateway_requests_total", status="rejected") == 1


def test_client_disconnect_aborts_the_engine_request(two_engines) -> None:  # type: ignore[no-untyped-def]
    a, _ = two_engines
    with running(gateway("gateway-disconnect", "--engine", a.url)) as (g,):
        body = {
            "model": "dsv4-tiny",
            "prompt": "x",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{g.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert a.metric("vllm:num_requests_running") >= 1
        deadline = time.monotonic() + 20
        while a.metric("vllm:num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert a.metric("vllm:num_requests_running") == 0, (
            "the engine kept generating for a client that left"
        )
        deadline = time.monotonic() + 5
        while g.metric("dsv4_gateway_inflight_requests") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert g.metric("dsv4_gateway_requests_total", status="cancelled") == 1
        assert g.metric("dsv4_gateway_inflight_requests") == 0


def test_dead_engine_is_ejected_and_nothing_hangs() -> None:
    a, b = engine("engine-x"), engine("engine-y")
    failover = gateway("gateway-failover", "--engine", a.url, "--engine", b.url, "--retries", "1")
    with running(a, b), running(failover) as (g,):

        async def load() -> list[tuple[int, str, float]]:
            async with httpx.AsyncClient(timeout=120) as c:

                async def one(i: int) -> tuple[int, str, float]:
                    t = time.monotonic()
                    body = {
                        "model": "dsv4-tiny",
                        "prompt": f"load {i}",
                        "max_tokens": 40,
                        "ignore_eos": True,
                        "stream": True,
                    }
                    text = ""
                    async with c.stream("POST", f"{g.url}/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            text += line
                        return r.status_code, text, time.monotonic() - t

                tasks = [asyncio.create_task(one(i)) for i in range(16)]
                await asyncio.sleep(1.0)
                b.stop()  # SIGTERM mid-load
                return await asyncio.gather(*tasks)

        results = asyncio.run(load())
        for status, text, took in results:
            assert took < 60
            assert status in (200, 502, 503)
            # either a complete answer, or a clear error: never a silent truncation
            assert "[DONE]" in text or "error" in text
        # afterwards every request succeeds on the survivor
        for i in range(6):
            r = httpx.post(
                f"{g.url}/v1/completions",
                json={"model": "dsv4-tiny", "prompt": f"after {i}", "max_tokens": 3},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        health = httpx.get(f"{g.url}/health", timeout=5).json()
        assert health["healthy"]["both"] == 1
        assert g.metric("dsv4_gateway_ejections_total", instance=b.url) == 1


def test_slowed_engine_receives_clearly_less() -> None:
    fast, slow = engine("engine-fast"), engine("engine-slow", "--max-num-seqs", "1")
    dplb = gateway("gateway-dplb", "--engine", fast.url, "--engine", slow.url, "--policy", "dplb")
    with running(fast, slow), running(dplb) as (g,):
        with ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda i: _complete(g.url, f"req {i}", max_tokens=48), range(48)))
        counts = routed_counts(g)
        assert counts[slow.url] < 0.6 * counts[fast.url], counts


def test_gateway_cli_errors_name_the_flag() -> None:
    for argv, flag in (
        (["--prefill", "http://127.0.0.1:1"], "--decode"),
        (["--engine", "localhost:1"], "http://"),
    ):
        r = subprocess.run(dsv4_argv("gateway", *argv), capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and flag in r.stderr
