"""dsv4_common.tracing: the endpoint's checks, tracing off costing nothing (no SDK, no spans),
W3C traceparent in and out, spans with measured times (a real SDK tracer, in memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dsv4_common import tracing
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.gateway.config import GatewayConfig


@pytest.fixture
def memory() -> tuple[object, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_endpoint_gets_the_traces_path_unless_it_names_one() -> None:
    assert tracing.traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert tracing.traces_url("http://h:4318/") == "http://h:4318/v1/traces"
    assert tracing.traces_url("https://h/otlp/v1/traces") == "https://h/otlp/v1/traces"


@pytest.mark.parametrize("bad", ["127.0.0.1:4318", "grpc://h:4317", "http://", ""])
def test_a_bad_endpoint_is_refused_by_every_config(bad: str) -> None:
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint"):
        EngineConfig(otlp_traces_endpoint=bad)
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        GatewayConfig(both_urls=["http://e"], otlp_traces_endpoint=bad)
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        SidecarConfig(token=b"x" * 16, otlp_traces_endpoint=bad)


def test_tracing_is_off_by_default_everywhere() -> None:
    assert EngineConfig().otlp_traces_endpoint is None
    assert GatewayConfig(both_urls=["http://e"]).otlp_traces_endpoint is None
    assert SidecarConfig(token=b"x" * 16).otlp_traces_endpoint is None
    assert tracing.setup(None, "dsv4-test") is None


def test_off_loads_no_sdk_and_makes_no_span() -> None:
    code = (
        "import sys\n"
        "from dsv4_common import tracing\n"
        "assert tracing.setup(None, 'x') is None\n"
        "with tracing.span(None, 'n') as s:\n"
        "    assert s is None\n"
        "import dsv4_serving.gateway.app, dsv4_serving.entrypoints.api_server\n"
        "import dsv4_kvtransfer.sidecar\n"
        "bad = [m for m in sys.modules if m.startswith('opentelemetry.sdk')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_traceparent_round_trip(memory: tuple[object, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    parent = tracing.start(tracer, "parent", None)  # type: ignore[arg-type]
    tp = tracing.traceparent(parent)
    c = parent.get_span_context()
    assert tp == f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"
    assert int(tp[-2:], 16) & 1  # sampled
    child = tracing.start(tracer, "child", tracing.extract({"traceparent": tp}))  # type: ignore[arg-type]
    child.end()
    parent.end()
    got = {s.name: s for s in exporter.get_finished_spans()}
    assert got["child"].parent is not None
    assert got["child"].parent.span_id == c.span_id
    assert got["child"].context.trace_id == c.trace_id


@pytest.mark.parametrize("value", [None, "", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])
def test_no_or_invalid_traceparent_starts_a_new_trace(value: str | None) -> None:
    assert tracing.from_traceparent(value) is None
    assert tracing.extract({} if value is None else {"traceparent": value}) is None


def test_record_keeps_the_measured_times_and_the_error(
    memory: tuple[object, InMemorySpanExporter],
) -> None:
    tracer, exporter = memory
    s = tracing.record(tracer, "x", None, 1_000, 5_000, {"a": 1}, "client", error="boom")  # type: ignore[arg-type]
    (done,) = exporter.get_finished_spans()
    assert (done.start_time, done.end_time) == (1_000, 5_000)
    assert done.attributes == {"a": 1}
    assert done.kind.name == "CLIENT"
    assert done.status.status_code.name == "ERROR" and done.status.description == "boom"
    assert s is not None


def test_span_marks_an_exception_and_ends(memory: tuple[object, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    with pytest.raises(RuntimeError), tracing.span(tracer, "y") as s:  # type: ignore[arg-type]
        assert s is not None
        raise RuntimeError("bad")
    (done,) = exporter.get_finished_spans()
    assert done.status.status_code.name == "ERROR"
    assert "RuntimeError: bad" in str(done.status.description)
