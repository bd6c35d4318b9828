"""The KV sidecar's spans (a real SDK tracer, in memory): a lease from reservation to free with
its reason (an expiry is an error), a transfer with bytes, transport and bandwidth; nothing for
a call without a traceparent."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dsv4_common import tracing
from dsv4_kvtransfer.kv_spans import SidecarSpans


def _spans() -> tuple[SidecarSpans, InMemorySpanExporter, str]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    parent = tracing.start(tracer, "engine", None)
    return SidecarSpans(tracer, "sc-1", "tcp"), exporter, tracing.traceparent(parent)


def test_lease_from_reservation_to_free() -> None:
    spans, exporter, tp = _spans()
    spans.export_reserved("t1", tp, 4096, "req-1")
    spans.export_reserved("t2", tp, 10, "req-2")
    spans.export_freed("t1", "pulled")
    spans.export_freed("t2", "expired")
    spans.export_freed("t3", "pulled")  # never reserved with a trace: nothing
    a, b = exporter.get_finished_spans()
    assert a.name == b.name == "dsv4.kv.lease"
    assert dict(a.attributes or {}) == {
        "dsv4.sidecar.id": "sc-1",
        "dsv4.kv.transfer_id": "t1",
        "dsv4.kv.bytes": 4096,
        "dsv4.kv.freed": "pulled",
        "dsv4.engine.request_id": "req-1",
    }
    assert a.status.status_code.name == "UNSET"
    assert b.status.status_code.name == "ERROR"
    assert a.parent is not None and a.end_time is not None and a.start_time is not None
    assert a.end_time >= a.start_time


def test_transfer_with_bandwidth_and_a_failed_one() -> None:
    spans, exporter, tp = _spans()
    spans.transfer(tp, 1_000, 2_000_000, 0.5, "10.0.0.1:14579")
    spans.transfer(tp, 1_000, 100, None, "10.0.0.1:14579", "TimeoutError: slow", "timeout")
    ok, failed = exporter.get_finished_spans()
    assert ok.kind.name == "CLIENT" and ok.start_time == 1_000
    assert ok.attributes is not None
    assert ok.attributes["dsv4.kv.bandwidth_bytes_per_s"] == 4_000_000
    assert ok.attributes["dsv4.kv.transport"] == "tcp"
    assert ok.attributes["server.address"] == "10.0.0.1:14579"
    assert failed.status.status_code.name == "ERROR"
    assert failed.attributes is not None and failed.attributes["dsv4.kv.failure"] == "timeout"
    assert "dsv4.kv.bandwidth_bytes_per_s" not in failed.attributes


def test_no_traceparent_no_span() -> None:
    spans, exporter, _ = _spans()
    spans.export_reserved("t1", None, 1, "r")
    spans.export_freed("t1", "pulled")
    spans.transfer(None, 0, 1, 1.0, "h:1")
    assert not exporter.get_finished_spans()
