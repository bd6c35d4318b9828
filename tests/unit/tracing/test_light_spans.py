"""dsv4_common.light_spans: W3C traceparent in and out, ids, parent/child, sampling by the
parent's flag, and the hand-made OTLP protobuf read back with the protobuf classes."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from dsv4_common import light_spans, tracing
from dsv4_common.light_spans import Recorder, parse_traceparent

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
PARENT = 0xB7AD6B7169203331


@pytest.fixture
def sent() -> list[bytes]:
    return []


@pytest.fixture
def recorder(sent: list[bytes]) -> Recorder:
    return Recorder("http://collector/v1/traces", "svc", schedule_s=None, post=sent.append)


def _decoded(sent: list[bytes]) -> ExportTraceServiceRequest:
    (body,) = sent
    return ExportTraceServiceRequest.FromString(body)


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def test_parse_traceparent() -> None:
    tp = f"00-{TRACE:032x}-{PARENT:016x}-01"
    assert parse_traceparent(tp) == (TRACE, PARENT, True)
    assert parse_traceparent(tp[:-2] + "00") == (TRACE, PARENT, False)
    assert parse_traceparent(f" {tp} ") == (TRACE, PARENT, True)
    # a later version may add fields
    assert parse_traceparent("cc" + tp[2:] + "-what-follows") == (TRACE, PARENT, True)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        f"00-{0:032x}-{PARENT:016x}-01",  # zero trace id
        f"00-{TRACE:032x}-{0:016x}-01",  # zero span id
        f"ff-{TRACE:032x}-{PARENT:016x}-01",  # version ff is invalid
        f"00-{TRACE:032x}-{PARENT:016x}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE:032X}-{PARENT:016x}-01",  # upper case
        f"00-{TRACE:031x}-{PARENT:016x}-01",  # short
    ],
)
def test_an_invalid_traceparent_is_no_parent(value: str | None) -> None:
    assert parse_traceparent(value) is None


def test_a_root_span_takes_random_ids_and_children_share_its_trace(recorder: Recorder) -> None:
    random.seed(7)
    expect = random.Random(7)
    root = recorder.start("root", None, {}, "server")
    child = recorder.start("child", root, {}, "client")
    assert root.trace_id == expect.getrandbits(128)
    assert root.span_id == expect.getrandbits(64)
    assert (root.parent_id, child.parent_id) == (0, root.span_id)
    assert child.trace_id == root.trace_id
    assert child.span_id == expect.getrandbits(64)
    assert child.traceparent() == f"00-{root.trace_id:032x}-{child.span_id:016x}-01"
    assert parse_traceparent(child.traceparent()) == (root.trace_id, child.span_id, True)


def test_a_remote_parent_is_honoured(recorder: Recorder, sent: list[bytes]) -> None:
    span = recorder.start("s", (TRACE, PARENT, True), {}, "server", start_ns=10)
    assert (span.trace_id, span.parent_id) == (TRACE, PARENT)
    span.end(20)
    recorder.flush()
    (got,) = _decoded(sent).resource_spans[0].scope_spans[0].spans
    assert got.trace_id == TRACE.to_bytes(16, "big")
    assert got.parent_span_id == PARENT.to_bytes(8, "big")
    assert got.span_id == span.span_id.to_bytes(8, "big")


def test_an_unsampled_parent_propagates_and_exports_nothing(
    recorder: Recorder, sent: list[bytes]
) -> None:
    span = recorder.start("s", (TRACE, PARENT, False), {}, "server")
    child = recorder.start("c", span, {}, "client")
    assert not span.sampled and not child.sampled
    assert child.traceparent() == f"00-{TRACE:032x}-{child.span_id:016x}-00"
    child.end()
    span.end()
    recorder.flush()
    assert sent == []


def test_the_export_is_otlp_protobuf_with_every_field(
    recorder: Recorder, sent: list[bytes]
) -> None:
    ok = recorder.start("ok", None, {"s": "x", "i": 7, "b": True, "f": 0.5}, "server", 1_000)
    bad = recorder.start("bad", ok, {"neg": -3, "l": ["a", "b"]}, "client", 2_000)
    bad.set_attribute("late", 200)
    bad.fail("upstream answered 500")
    bad.end(3_000)
    bad.end(9_000)  # ended once
    ok.end(5_000)
    recorder.flush()
    (rs,) = _decoded(sent).resource_spans
    assert {a.key: _value(a.value) for a in rs.resource.attributes} == {"service.name": "svc"}
    (ss,) = rs.scope_spans
    assert ss.scope.name == "dsv4"
    got_bad, got_ok = ss.spans  # in the order they ended
    assert (got_ok.name, got_ok.kind, got_ok.start_time_unix_nano, got_ok.end_time_unix_nano) == (
        "ok",
        2,  # SPAN_KIND_SERVER
        1_000,
        5_000,
    )
    assert got_ok.parent_span_id == b""
    assert {a.key: _value(a.value) for a in got_ok.attributes} == {
        "s": "x",
        "i": 7,
        "b": True,
        "f": 0.5,
    }
    assert got_ok.status.code == 0 and not got_ok.HasField("status")  # unset
    assert (got_bad.name, got_bad.kind) == ("bad", 3)  # SPAN_KIND_CLIENT
    assert (got_bad.start_time_unix_nano, got_bad.end_time_unix_nano) == (2_000, 3_000)
    assert got_bad.parent_span_id == got_ok.span_id
    assert got_bad.trace_id == got_ok.trace_id
    assert {a.key: _value(a.value) for a in got_bad.attributes} == {
        "neg": -3,
        "l": ["a", "b"],
        "late": 200,
    }
    assert got_bad.status.code == 2  # STATUS_CODE_ERROR
    assert got_bad.status.message == "upstream answered 500"


def test_an_end_before_the_start_is_clamped(recorder: Recorder, sent: list[bytes]) -> None:
    recorder.start("s", None, {}, start_ns=5_000).end(4_000)
    recorder.flush()
    (got,) = _decoded(sent).resource_spans[0].scope_spans[0].spans
    assert (got.start_time_unix_nano, got.end_time_unix_nano) == (5_000, 5_000)


def test_batches_are_split_and_a_full_queue_drops(sent: list[bytes]) -> None:
    r = Recorder(
        "http://c/v1/traces", "svc", schedule_s=None, max_queued=5, max_batch=2, post=sent.append
    )
    for i in range(7):
        r.start(f"s{i}", None, {"n": i}).end()
    assert r.dropped == 2
    r.flush()
    got = [
        s.name
        for body in sent
        for s in ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
    ]
    assert got == ["s0", "s1", "s2", "s3", "s4"]
    assert len(sent) == 3
    r.flush()
    assert len(sent) == 3  # nothing left


def test_a_failed_export_drops_the_batch_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def down(body: bytes) -> None:
        raise ConnectionRefusedError("refused")

    r = Recorder("http://c/v1/traces", "svc", schedule_s=None, post=down)
    r.start("s", None, {}).end()
    r.flush()
    assert "dropped 1 spans" in caplog.text and "refused" in caplog.text


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    got: list[tuple[str, str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            got.append((self.path, self.headers["content-type"], body))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", got
    finally:
        server.shutdown()
        server.server_close()


def test_the_background_thread_posts_to_the_endpoint(
    collector: tuple[str, list[tuple[str, str, bytes]]],
) -> None:
    url, got = collector
    r = Recorder(tracing.traces_url(url), "svc", {"k": "v"}, schedule_s=0.05)
    try:
        r.start("one", None, {}).end()
        for _ in range(100):
            if got:
                break
            threading.Event().wait(0.05)
        r.start("two", None, {}).end()
    finally:
        r.shutdown()  # exports "two" over the same connection
    assert [(path, ctype) for path, ctype, _ in got] == [
        ("/v1/traces", "application/x-protobuf")
    ] * 2
    names = [
        s.name
        for _, _, body in got
        for s in ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
    ]
    assert names == ["one", "two"]
    res = ExportTraceServiceRequest.FromString(got[0][2]).resource_spans[0].resource
    assert {a.key: a.value.string_value for a in res.attributes} == {
        "service.name": "svc",
        "k": "v",
    }


def test_off_is_none() -> None:
    assert light_spans.setup(None, "svc") is None
