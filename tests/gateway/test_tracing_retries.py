"""The gateway's routing spans with a failing prefill instance (real processes, a real Jaeger):
a retried prefill is two sibling attempt spans under the request's span, the failed one an
error with the upstream's status, the retry on the other instance; the request succeeds."""

from __future__ import annotations

import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsv4_common.process import Service, free_port
from dsv4_devcluster.jaeger import Jaeger, binary
from dsv4_serving.traces.query import TraceNotFound, fetch
from dsv4_serving.traces.waterfall import parse_jaeger
from tests.gateway.conftest import LOG_DIR, gateway, running

STUB = Path(__file__).resolve().parents[2] / "benchmarks" / "upstream_stub.py"
# healthy to the health checker, 500 to every request: the gateway must retry elsewhere
FAILING = textwrap.dedent(
    """
    import sys, uvicorn
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        ok = scope["method"] == "GET"
        body = b"{}" if ok else b'{"error": {"message": "boom", "type": "x", "code": "x"}}'
        await send({"type": "http.response.start", "status": 200 if ok else 500,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    """
)


def _process(name: str, argv: list[str], port: int) -> Service:
    return Service(name, argv, LOG_DIR / f"{name}-{port}.log", f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def traced_gateway() -> Iterator[tuple[Service, Jaeger]]:
    with tempfile.TemporaryDirectory(prefix="dsv4-trace-retry-") as tmp:
        jaeger = Jaeger.start(binary(), Path(tmp))
        ports = [free_port() for _ in range(3)]
        bad = _process("failing-prefill", [sys.executable, "-c", FAILING, str(ports[0])], ports[0])
        good = _process(
            "stub-prefill", [sys.executable, str(STUB), "--port", str(ports[1])], ports[1]
        )
        decode = _process(
            "stub-decode", [sys.executable, str(STUB), "--port", str(ports[2])], ports[2]
        )
        gw = gateway(
            "gateway-traced",
            "--policy",
            "round_robin",
            "--retries",
            "1",
            "--eject-after-failures",
            "100",  # keep the failing one in rotation: every other request retries
            "--prefill",
            bad.url,
            "--prefill",
            good.url,
            "--decode",
            decode.url,
            "--otlp-traces-endpoint",
            jaeger.otlp_endpoint,
        )
        try:
            with running(bad, good, decode, gw, timeout_s=60):
                yield gw, jaeger
        finally:
            jaeger.stop()


def test_a_retried_prefill_is_two_attempt_spans(traced_gateway: tuple[Service, Jaeger]) -> None:
    gw, jaeger = traced_gateway
    body = {"model": "stub", "prompt": "hello", "max_tokens": 4}
    rids = [f"retry-{uuid.uuid4().hex[:12]}" for _ in range(4)]
    for rid in rids:  # round robin (its turn advances with every choice): some start on the bad one
        r = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
    retried = 0
    deadline = time.monotonic() + 30
    for rid in rids:
        while True:
            try:
                spans = parse_jaeger(fetch(jaeger.query_url, rid, wait_s=1.0))
                if any(s.name == "dsv4.gateway.decode" for s in spans):
                    break
            except TraceNotFound:
                pass
            assert time.monotonic() < deadline, rid
            time.sleep(0.3)
        (root,) = [s for s in spans if s.parent_id is None]
        assert root.attributes["dsv4.request_id"] == rid
        assert root.attributes["dsv4.gateway.outcome"] == "ok"
        attempts = sorted(
            (s for s in spans if s.name == "dsv4.gateway.prefill"),
            key=lambda s: s.attributes["dsv4.gateway.attempt"],
        )
        assert all(s.parent_id == root.span_id for s in attempts)
        assert [s.attributes["dsv4.gateway.attempt"] for s in attempts] == list(
            range(len(attempts))
        )
        *failed, last = attempts
        assert not last.error and last.attributes["http.response.status_code"] == 200
        for f in failed:
            assert f.error and f.attributes["http.response.status_code"] == 500
            assert f.attributes["server.address"] != last.attributes["server.address"]
            assert f.attributes["dsv4.gateway.policy"] == "round_robin"
            assert f.end_us <= last.start_us + 1000
        retried += bool(failed)
    assert retried >= 1, "no request was retried"
