"""Property-based tests of the engine's and the gateway's HTTP APIs from their OpenAPI
documents (``fuzzing.fuzz_openapi``), real processes: no 5xx, every error the OpenAI body,
no hang, and afterwards no KV block held and nothing in flight. Small example counts here;
``scripts/fuzz`` runs the same with many more."""

from __future__ import annotations

import time

from dsv4_common.process import Service
from tests.gateway.conftest import engine, gateway, running
from tests.gateway.fuzzing import fuzz_openapi

# a short context keeps every generated request quick (longer ones are 400s)
ENGINE = ("--max-model-len", "48", "--num-kv-blocks", "64", "--num-speculative-tokens", "0")


def _settled(e: Service, g: Service, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        total = e.metric("dsv4_kv_cache_total_blocks")
        free = e.metric("dsv4_kv_cache_free_blocks")
        busy = e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting")
        inflight = g.metric("dsv4_gateway_inflight_requests")
        if free == total and busy == 0 and inflight == 0:
            return
        assert time.monotonic() < deadline, f"leaked: {free}/{total} free, {busy}, {inflight}"
        time.sleep(0.2)


def test_engine_and_gateway_apis_survive_fuzzing() -> None:
    e = engine("fuzz-engine", *ENGINE)
    with running(e):
        g = gateway("fuzz-gateway", "--engine", e.url)
        with running(g):
            engine_report = fuzz_openapi(e.url)
            gateway_report = fuzz_openapi(g.url)
            print(f"engine:\n{engine_report}\ngateway:\n{gateway_report}")
            assert len(engine_report.tried) >= 6 and len(gateway_report.tried) >= 7
            assert all(engine_report.tried.values()) and all(gateway_report.tried.values())
            _settled(e, g)
            assert e.running() and g.running()
